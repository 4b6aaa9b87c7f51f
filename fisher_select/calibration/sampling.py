"""Plain ancestral sampling from the model itself, batched with the KV cache, seeded.

The Fisher is an expectation under the model's own distribution, so responses must come from
the full next-token distribution at temperature 1. This loop is written out rather than calling
``generate``: ``generate(do_sample=True)`` silently keeps only the 50 most likely tokens unless
told otherwise, and a model's ``generation_config`` may carry top-p or repetition penalties.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.engine.logprob import position_ids_from_mask


@dataclass
class SamplingConfig:
    """Sampling settings. Only the plain setting estimates the model Fisher; others are refused."""

    temperature: float = field(default=1.0, metadata={"help": "softmax temperature; only 1 is accepted"})
    top_k: int | None = field(default=None, metadata={"help": "keep the k likeliest tokens; only unset or 0 is accepted"})
    top_p: float | None = field(default=None, metadata={"help": "nucleus sampling; only unset or 1 is accepted"})
    min_p: float | None = field(default=None, metadata={"help": "min-p truncation; only unset or 0 is accepted"})
    typical_p: float | None = field(default=None, metadata={"help": "typical sampling; only unset or 1 is accepted"})
    repetition_penalty: float | None = field(default=None, metadata={
        "help": "repetition penalty; only unset or 1 is accepted"})

    def problems(self) -> list[str]:
        """Why this setting is not plain ancestral sampling (empty when it is)."""
        plain = {"temperature": 1.0, "top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0),
                 "typical_p": (None, 1.0), "repetition_penalty": (None, 1.0)}
        out = []
        for f in fields(self):
            value, ok = getattr(self, f.name), plain[f.name]
            if value not in (ok if isinstance(ok, tuple) else (ok,)):
                out.append(
                    f"sampling.{f.name}={value!r} is not plain sampling: the Fisher is an expectation under "
                    "the model's own distribution, so responses must be drawn at temperature 1 with no "
                    "truncation or penalty; remove the setting"
                )
        return out

    def describe(self) -> dict:
        return {"method": "ancestral", "temperature": 1.0, "top_k": None, "top_p": None, "min_p": None,
                "typical_p": None, "repetition_penalty": None}


@dataclass
class Sampled:
    """One response: its token ids, its fp32 log-probability, and whether it ended with EOS."""

    response_ids: list[int]
    logprob: float
    ended: bool


Observer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists: (B, T) ids and attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[b, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample_responses(
    model,
    prompts: list[list[int]],
    *,
    eos_ids: set[int],
    pad_id: int,
    max_new_tokens: int,
    generator: torch.Generator,
    observer: Observer | None = None,
) -> list[Sampled]:
    """Draw one response per prompt row (repeat a prompt K times for K samples).

    ``observer(probs (B, V), tokens (B,), active (B,))``, if given, sees every step's full
    distribution (tests use it to check that tokens beyond any top-k appear at the right rate).
    """
    if max_new_tokens < 1:
        raise FisherSelectError("max_new_tokens must be at least 1")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)  # (B, P)
    eos = torch.tensor(sorted(eos_ids), device=device)
    cache_kw = _cache_keyword(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True)
    cache, logits = _cache_of(out), out.logits[:, -1].to(device)
    batch = ids.shape[0]
    active = torch.ones(batch, dtype=torch.bool, device=device)
    ended = torch.zeros_like(active)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    tokens, logps = [], []
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V) fp32, the full vocabulary
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)  # (B,)
        if observer is not None:
            observer(logp.exp(), tok, active.clone())
        tok = torch.where(active, tok, torch.full_like(tok, pad_id))  # finished rows: padding
        logps.append(torch.where(active, logp.gather(1, tok[:, None]).squeeze(1), 0.0))
        tokens.append(tok)
        lengths += active
        is_eos = active & torch.isin(tok, eos)
        ended |= is_eos
        mask = torch.cat([mask, active.long()[:, None]], dim=1)
        active = active & ~is_eos
        if not active.any() or step == max_new_tokens - 1:
            break
        pos = position_ids_from_mask(mask)[:, -1:]
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
        cache, logits = _cache_of(out), out.logits[:, -1].to(device)
    toks = torch.stack(tokens, 1).cpu()  # (B, L)
    lps = torch.stack(logps, 1).double().cpu()  # (B, L)
    return [
        Sampled(toks[b, : lengths[b]].tolist(), float(lps[b, : lengths[b]].sum()), bool(ended[b]))
        for b in range(batch)
    ]


def _cache_keyword(model) -> str:
    """transformers >= 5.2x names the KV cache ``cache``; earlier releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]
