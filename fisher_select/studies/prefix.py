"""Scoring many rows that share a prompt prefix, the prefix computed once (exact: same numbers to fp32 rounding).

Every row of the study's scoring (the answer-token NLL, SFT's held-out demonstrations, the general
prompts' KL) starts with the same rendered prefix: the system prompt and the solved examples. A
causal model's keys and values over that prefix do not depend on what follows, so they are computed
once (batch 1), repeated over a micro-batch, and only each row's own suffix is run. Positions count
on from the prefix, as in the plain left-padded path (``engine.logprob``), so the log-probabilities
are the plain path's up to fp32 rounding (tests/test_outcomes_v2.py checks it against the plain
path). Greedy decoding (``greedy``) keeps its KV cache between steps instead of running the whole
sequence again for each new token. ``CACHED = False`` turns both off (``bench/outcomes.py --time-cell`` times both).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache

from fisher_select.calibration.sampling import _cache_keyword, _cache_of, _mergeable, left_pad, pad_rows
from fisher_select.engine.logprob import forward_logits, position_ids_from_mask, response_logprobs

CACHED = True  # the cached paths: shared prefix once, KV cache in greedy decoding; False: the plain path
MIN_PREFIX = 8  # a shorter common prefix is not worth a separate pass


def common_prefix(rows) -> int:
    """The rows' longest common prefix, at most ``min(start) - 1`` tokens, so that the logit of each
    row's first scored token comes from the row's own suffix pass."""
    first = rows[0].ids
    n = min(min(len(r.ids) for r in rows), min(r.start for r in rows) - 1)
    for p in range(max(n, 0)):
        if any(r.ids[p] != first[p] for r in rows):
            return p
    return max(n, 0)


def _plain(model, rows, pad_id: int, device, micro: int) -> list[float]:
    out = []
    for i in range(0, len(rows), micro):
        ids, mask, resp = pad_rows(rows[i : i + micro], pad_id, device)  # (B, T) each
        out += response_logprobs(model, ids, mask, resp).tolist()
    return out


@torch.no_grad()
def row_logprobs(model, rows, pad_id: int, device, micro: int = 8) -> list[float]:
    """Per row (``ScoringRow``: ``ids``, ``start``): the summed fp32 log-probability of its tokens from
    ``start`` on, the rows' common prefix computed once when ``CACHED`` (else the plain path)."""
    p = common_prefix(rows) if rows else 0
    if not CACHED or p < MIN_PREFIX:
        return _plain(model, rows, pad_id, device, micro)
    cache = _prefix_cache(model, rows[0].ids[:p], device)
    out = []
    for i in range(0, len(rows), micro):
        out += _suffix_pass(model, rows[i : i + micro], p, cache, pad_id, device)
    return out


def _prefix_cache(model, ids: list[int], device):
    """The KV cache of the shared prefix ``ids`` (batch 1, positions from 0)."""
    prefix = torch.tensor([ids], device=device)  # (1, P)
    return _cache_of(model(input_ids=prefix, attention_mask=torch.ones_like(prefix),
                           position_ids=torch.arange(len(ids), device=device)[None], use_cache=True))


def _suffix_pass(model, rows, p: int, cache, pad_id: int, device) -> list[float]:
    """One micro-batch of ``row_logprobs`` over a copy of the prefix's cache, repeated for its rows."""
    past = copy.deepcopy(cache)
    past.batch_repeat_interleave(len(rows))
    return _suffix_logprobs(model, rows, p, past, pad_id, device).tolist()


def _suffix_logprobs(model, rows, p: int, past, pad_id: int, device, weights=None) -> torch.Tensor:
    """(B,): each row's suffix after the P shared tokens, right padded, run over ``past`` (the prefix's keys
    and values, one row per row); the summed fp32 log-probability of its tokens from ``start`` on, each
    weighted by ``weights[k]`` ((L_k,) per response token, as ``loop.Batch`` holds them; None: all 1)."""
    b, width = len(rows), max(len(r.ids) for r in rows) - p
    ids = torch.full((b, width), pad_id, dtype=torch.long, device=device)  # (B, S)
    real = torch.zeros((b, width), dtype=torch.bool, device=device)  # (B, S)
    scored = torch.zeros((b, width), dtype=torch.float32, device=device)  # (B, S): each token's weight
    for k, r in enumerate(rows):
        n = len(r.ids) - p
        ids[k, :n] = torch.tensor(r.ids[p:], device=device)
        real[k, :n] = True
        scored[k, r.start - p : n] = 1.0 if weights is None else weights[k].to(device)  # start - p >= 1
    mask = torch.cat([torch.ones((b, p), dtype=torch.long, device=device), real.long()], dim=1)  # (B, P + S)
    positions = (p + torch.arange(width, device=device))[None].expand(b, -1)  # (B, S): the plain path's
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{_cache_keyword(model): past}).logits  # (B, S, V)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # fp32: token j is predicted at j - 1
    per_token = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, S - 1)
    return (per_token * scored[:, 1:]).sum(-1)


def prefix_backward(model, rows, weights, sign: float, denominator: int, pad_id: int, micro: int) -> float | None:
    """Backpropagate ``sign * sum_rows sum_t w_t log pi(y_t|s_t) / denominator`` with the rows' common prefix
    run once (batch 1) instead of once per row; the summed loss, or None (nothing done) when the rows share
    no prefix worth it or the model's cache is not transformers' plain ``DynamicCache``.

    Exact: the prefix's keys and values are cut from their graph as leaves, every micro-batch's suffix
    backpropagates into them (their gradient sums over the rows that read them), then one backward
    carries that sum through the prefix pass. The parameters' gradient is the plain path's, to fp32
    rounding (tests/test_outcomes_v2.py checks it in float64)."""
    p = common_prefix(rows) if CACHED and rows else 0
    if p < MIN_PREFIX:
        return None
    device = next(model.parameters()).device
    cache = _prefix_cache(model, rows[0].ids[:p], device)
    if not _mergeable(cache):  # sliding windows, offloading, other caches: the plain path
        return None
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # (1, heads, P, d) each, in the graph
    leaves = [t.detach().requires_grad_() for t in kv]
    total = 0.0
    for i in range(0, len(rows), micro):
        part = rows[i : i + micro]
        past = DynamicCache([(k.expand(len(part), -1, -1, -1), v.expand(len(part), -1, -1, -1))
                             for k, v in zip(leaves[::2], leaves[1::2])])
        w = None if weights is None else weights[i : i + micro]
        loss = sign * _suffix_logprobs(model, part, p, past, pad_id, device, w).sum() / denominator
        loss.backward()
        total += float(loss.detach())
    # a layer whose keys and values depend on no trainable parameter (frozen early layers) has no graph
    reached = [(t, leaf.grad) for t, leaf in zip(kv, leaves) if leaf.grad is not None and t.requires_grad]
    if reached:
        torch.autograd.backward([t for t, _ in reached], [g for _, g in reached])
    return total


@torch.no_grad()
def greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad_id: int, device) -> list[list[int]]:
    """Greedy responses (without their end-of-sequence token) of left-padded ``prompts``, decoded with a KV
    cache when ``CACHED`` (else each step runs the whole sequence again, the plain path)."""
    responses, done = [[] for _ in prompts], [False] * len(prompts)
    ids, mask = left_pad(prompts, pad_id, device)  # (B, T)
    past = None
    for _ in range(max_new_tokens):
        if not CACHED:
            ids_now, mask_now = left_pad([p + r for p, r in zip(prompts, responses)], pad_id, device)
            nxt = forward_logits(model, ids_now, mask_now, 1)[:, -1].float().argmax(-1)  # (B,)
        else:
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)[:, -ids.shape[1]:],
                        use_cache=True, **{_cache_keyword(model): past})
            past, nxt = _cache_of(out), out.logits[:, -1].float().argmax(-1)  # (B,)
            ids = nxt[:, None]  # (B, 1): the next step runs the new token alone
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)  # (B, T + 1)
        for b, t in enumerate(nxt.tolist()):
            if not done[b]:
                done[b] = t in eos
                if not done[b]:
                    responses[b].append(t)
        if all(done):
            break
    return responses
