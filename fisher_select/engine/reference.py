"""Brute-force references, shipped with the package so anyone can check the fast paths.

- ``per_sample_scores``: each row run alone, unpadded, one ``autograd.grad`` per sample.
- ``brute_force_sums``: the ``score_sums`` quantities from those per-sample gradients.
- ``enumerate_responses``: every response of a tiny model (small vocabulary, short responses),
  with its exact probability, for exact expectations (Fisher, gradients, signal scales).
- ``per_token_scores``: one backward per response token (token-level Fisher).
- ``verify_against_autograd``: a calibration's score sums of one batch against plain autograd
  (the calibrator's first-batch check).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from fisher_select.engine.batching import micro_batches
from fisher_select.engine.logprob import response_logprobs
from fisher_select.engine.scoring import Coverage, ScoreSums
from fisher_select.errors import FisherSelectError


def _unpadded_row(input_ids, attention_mask, response_mask, b):
    keep = attention_mask[b].bool()
    ids = input_ids[b, keep][None]
    return ids, torch.ones_like(ids), response_mask[b, keep][None]


def per_sample_scores(model, input_ids, attention_mask, response_mask, token_weights=None) -> list[dict]:
    """h_n for each row: gradient of its summed response log-probability, computed alone."""
    params = dict(model.named_parameters())  # tied parameters once
    out = []
    for b in range(input_ids.shape[0]):
        ids, attn, resp = _unpadded_row(input_ids, attention_mask, response_mask, b)
        w = None
        if token_weights is not None:
            w = token_weights[b, attention_mask[b].bool()][None]
        logp = response_logprobs(model, ids, attn, resp, w)[0]
        grads = torch.autograd.grad(logp, list(params.values()), allow_unused=True)
        out.append(
            {n: (torch.zeros_like(p) if g is None else g).double() for (n, p), g in zip(params.items(), grads)}
        )
    return out


def brute_force_sums(model, input_ids, attention_mask, response_mask, signal=None, token_weights=None):
    """(squares, signal_sums, total) in float64 from the per-sample loop."""
    scores = per_sample_scores(model, input_ids, attention_mask, response_mask, token_weights)
    squares = {n: sum(s[n] ** 2 for s in scores) for n in scores[0]}
    total = {n: sum(s[n] for s in scores) for n in scores[0]}
    weighted = None
    if signal is not None:
        weighted = {n: sum(float(a) * s[n] for a, s in zip(signal, scores)) for n in scores[0]}
    return squares, weighted, total


def per_token_scores(model, prompt_ids: list[int], response_ids: list[int]) -> list[dict]:
    """One backward per response token: d log pi(y_t | s_t) / d theta for each t."""
    ids = torch.tensor([prompt_ids + response_ids])
    mask = torch.ones_like(ids)
    params = dict(model.named_parameters())
    out = []
    for t in range(len(prompt_ids), ids.shape[1]):
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[0, t] = True
        logp = response_logprobs(model, ids, mask, resp)[0]
        grads = torch.autograd.grad(logp, list(params.values()), allow_unused=True)
        out.append({n: (torch.zeros_like(p) if g is None else g).double() for (n, p), g in zip(params.items(), grads)})
    return out


@dataclass
class Outcome:
    """One possible response: its tokens, exact probability and whether it ended with EOS."""

    response: list[int]
    prob: float
    ended: bool


def enumerate_responses(model, prompt_ids: list[int], eos_ids: set[int], max_new_tokens: int) -> list[Outcome]:
    """Every outcome of plain ancestral sampling, with its exact probability.

    A response stops at the first EOS or is truncated after ``max_new_tokens`` tokens; the
    outcome probabilities sum to one. Exponential in ``max_new_tokens``: tiny models only.
    """
    vocab = model.config.vocab_size
    outcomes = []
    with torch.no_grad():
        for length in range(1, max_new_tokens + 1):
            for body in itertools.product([v for v in range(vocab) if v not in eos_ids], repeat=length - 1):
                for last in range(vocab):
                    resp = list(body) + [last]
                    ended = last in eos_ids
                    if not ended and length < max_new_tokens:
                        continue  # not an outcome: sampling would continue
                    outcomes.append(Outcome(resp, 0.0, ended))
        for o in outcomes:
            o.prob = float(sequence_logprob(model, prompt_ids, o.response).exp())
    return outcomes


def sequence_logprob(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """log pi(response | prompt) in fp32 (a scalar tensor, differentiable)."""
    ids = torch.tensor([prompt_ids + response_ids])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[0, len(prompt_ids) :] = True
    return response_logprobs(model, ids, torch.ones_like(ids), resp)[0]


def verify_against_autograd(model, input_ids, attention_mask, response_mask, sums: ScoreSums, cov: Coverage,
                            max_tokens: int | None = None) -> dict:
    """Compare the engine's ``sum_n h_n`` with plain autograd of ``sum_n l_n``.

    A parameter used outside the module that holds it (a functional matmul with another
    module's weight) would be missed by the hooks; this catches it on the first batch.
    ``max_tokens``: the scoring's token budget, which caps this pass's activations too.
    """
    params = {n: p for n, p in cov.params.items()
              if n in cov.shapes and p.is_floating_point() and tuple(p.shape) == cov.shapes[n]}  # kept ones only
    saved = {n: p.requires_grad for n, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        grads = _summed_grads(model, (input_ids, attention_mask, response_mask), list(params.values()), max_tokens)
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])
    half = next(iter(params.values())).dtype in (torch.bfloat16, torch.float16) if params else False
    tol = 5e-2 if half else 1e-3
    worst, worst_name = 0.0, None
    for (name, _), g in zip(params.items(), grads):
        ref = torch.zeros(cov.shapes[name]) if g is None else g.float().cpu()
        mine = sums.total[name].cpu()
        err = float((mine - ref).norm() / (ref.norm() + mine.norm() + 1e-12))
        if err > worst:
            worst, worst_name = err, name
    if worst > tol:
        raise FisherSelectError(
            f"score sums for {worst_name} differ from autograd (relative error {worst:.2e} > {tol:g}): "
            "the parameter is probably used outside the module that holds it; please report this model"
        )
    return {"max_relative_error": worst, "parameter": worst_name, "tolerance": tol}


def _summed_grads(model, batch: tuple, params: list, max_tokens: int | None) -> list:
    """Autograd of the batch's summed log-probabilities (batch: (B, T) ids, mask, response mask), a
    micro-batch at a time when the batch exceeds ``max_tokens``; None for a parameter without gradient."""
    parts = micro_batches(batch[1], max_tokens)
    total = [None] * len(params)
    for rows in parts:
        pick = torch.tensor(rows, device=batch[0].device)
        part = batch if len(parts) == 1 else tuple(t.index_select(0, pick) for t in batch)  # (b, T) each
        grads = torch.autograd.grad(response_logprobs(model, *part).sum(), params, allow_unused=True)
        total = [g if t is None else t if g is None else t + g for t, g in zip(total, grads)]
    return total
