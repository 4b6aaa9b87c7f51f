"""Plain ancestral sampling from the model itself, batched with the KV cache, seeded.

The Fisher is an expectation under the model's own distribution, so responses must come from
the full next-token distribution at temperature 1. This loop is written out rather than calling
``generate``: ``generate(do_sample=True)`` silently keeps only the 50 most likely tokens unless
told otherwise, and a model's ``generation_config`` may carry top-p or repetition penalties.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.calibration.config import SamplingConfig  # noqa: F401  (its former home: imports still work)
from fisher_select.engine.logprob import position_ids_from_mask


@dataclass
class Sampled:
    """One response: its token ids, its fp32 log-probability, and whether it ended with EOS."""

    response_ids: list[int]
    logprob: float
    ended: bool


Observer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def eos_ids_of(model, tokenizer) -> set[int]:
    """EOS ids from the tokenizer and the model's generation config (which may list several)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if not ids:
        raise FisherSelectError("the tokenizer defines no EOS token: responses would never end; set tokenizer.eos_token")
    return ids


def pad_id_of(model, tokenizer) -> int:
    """The padding id: the tokenizer's, else the smallest EOS id (padding is masked out either way)."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else min(eos_ids_of(model, tokenizer))


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists: (B, T) ids and attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[b, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def pad_rows(rows, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded (B, T) ids, attention mask and response mask of prompt + response rows (each with
    ``.ids``, the prompt and response tokens, and ``.start``, where the response begins)."""
    ids, mask = left_pad([r.ids for r in rows], pad_id, device)
    resp = torch.zeros_like(ids, dtype=torch.bool)
    width = ids.shape[1]
    for b, r in enumerate(rows):
        resp[b, width - len(r.ids) + r.start :] = True
    return ids, mask, resp


BUCKET_WASTE = 0.25  # a prefill bucket's padded tokens may exceed its real ones by this share


@torch.no_grad()
def sample_responses(
    model, prompts: list[list[int]], *, eos_ids: set[int], pad_id: int, max_new_tokens: int,
    generator: torch.Generator | Sequence[torch.Generator], observer: Observer | None = None,
    bucket_waste: float | None = BUCKET_WASTE,
    compact: bool = True,
) -> list[Sampled]:
    """Draw one response per prompt row (repeat a prompt K times for K samples).

    Throughput without changing the distribution (every step samples the full fp32 softmax at
    temperature 1, ``torch.multinomial`` on the live rows, one seeded generator):

    - each distinct prompt is prefilled once and its KV cache repeated for its K rows;
    - distinct prompts are prefilled in buckets of similar length (sorted; a bucket's padded
      tokens exceed its real ones by at most ``bucket_waste``; None: one padded prefill), and
      the buckets' caches are left padded into one (masked positions are never attended);
    - rows that sampled EOS leave the batch (``compact``): later steps run the live rows only.

    Caches other than transformers' plain ``DynamicCache`` fall back to one padded prefill of the
    distinct prompts; models whose cache cannot select batch rows, to the plain loop over all
    rows. Same seed, prompts and settings: same responses.
    ``observer(probs (b, V), tokens (b,), active (b,))``, if given, sees every step's full
    distribution of the b rows still sampling (tests use it to check that tokens beyond any
    top-k appear at the right rate).
    ``generator`` may be one generator per row: each row then draws from its own, so its response does
    not depend on which other rows share the pass (common random numbers across batches and models).
    """
    if max_new_tokens < 1:
        raise FisherSelectError("max_new_tokens must be at least 1")
    device = next(model.parameters()).device
    batch = len(prompts)
    if not isinstance(generator, torch.Generator) and len(generator) != batch:
        raise FisherSelectError(f"sample_responses got {len(generator)} generators for {batch} rows; pass one "
                                "generator, or one per row")
    eos = torch.tensor(sorted(eos_ids), device=device)
    cache_kw = _cache_keyword(model)
    cache, logits, mask = _prefill(model, prompts, pad_id, device, bucket_waste)  # logits (B, V), mask (B, P)
    compact = compact and hasattr(cache, "batch_select_indices")
    rows = torch.arange(batch, device=device)  # original row of each row still in the batch
    active = torch.ones(batch, dtype=torch.bool, device=device)  # of the rows in the batch
    drawn = _Drawn(batch, max_new_tokens, pad_id, device)
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)  # (b, V) fp32, the full vocabulary
        tok = _draw(logp.exp(), rows, generator)  # (b,)
        if observer is not None:
            observer(logp.exp(), tok, active.clone())
        tok = torch.where(active, tok, torch.full_like(tok, pad_id))  # finished rows (no compaction): padding
        is_eos = drawn.record(step, rows, active, tok, logp, eos)
        mask = torch.cat([mask, active.long()[:, None]], dim=1)
        active = active & ~is_eos
        if not active.any() or step == max_new_tokens - 1:
            break
        if compact and not active.all():  # drop the finished rows from the batch and its cache
            keep = active.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, mask, tok, active = rows[keep], mask[keep], tok[keep], active[keep]
        pos = position_ids_from_mask(mask)[:, -1:]
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
        cache, logits = _cache_of(out), out.logits[:, -1].to(device)
    return drawn.sampled()


def _draw(probs: torch.Tensor, rows: torch.Tensor, generator) -> torch.Tensor:
    """One token per row of ``probs`` (b, V): from one generator, or each row from its own (``rows``: the
    original row of each row still in the batch)."""
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.cat([torch.multinomial(probs[j], 1, generator=generator[r]) for j, r in enumerate(rows.tolist())])


class _Drawn:
    """The tokens drawn so far, per original row: (B, L) tokens and their log-probabilities, lengths, EOS."""

    def __init__(self, batch: int, max_new_tokens: int, pad_id: int, device):
        self.tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)  # (B, L)
        self.logps = torch.zeros(batch, max_new_tokens, dtype=torch.float64, device=device)  # (B, L)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,) of all rows

    def record(self, step: int, rows, active, tok, logp, eos) -> torch.Tensor:
        """Keep step's tokens tok (b,) of the active rows (b,) (original rows ``rows``); returns which drew EOS."""
        live = rows[active]
        self.tokens[live, step] = tok[active]
        self.logps[live, step] = logp.gather(1, tok[:, None]).squeeze(1)[active].double()
        self.lengths[live] += 1
        is_eos = active & torch.isin(tok, eos)
        self.ended[rows[is_eos]] = True
        return is_eos

    def sampled(self) -> list[Sampled]:
        toks, lps, lengths, ended = self.tokens.cpu(), self.logps.cpu(), self.lengths.tolist(), self.ended.tolist()
        return [Sampled(toks[b, : lengths[b]].tolist(), float(lps[b, : lengths[b]].sum()), ended[b])
                for b in range(len(toks))]


def _forward_last(model, ids: torch.Tensor, mask: torch.Tensor, device):
    """Prefill of left-padded (b, P) rows: the cache and the last position's logits (b, V)."""
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True,
                **kwargs)
    return _cache_of(out), out.logits[:, -1].to(device)


def buckets(lengths: list[int], waste: float | None) -> list[list[int]]:
    """Indices of ``lengths`` in ascending-length buckets; a bucket's padded size (count x longest)
    is at most (1 + waste) x its real tokens. None: one bucket."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if waste is None:
        return [order]
    out, real = [], 0
    for i in order:
        n = lengths[i]
        if out and (len(out[-1]) + 1) * n <= (1 + waste) * (real + n):
            out[-1].append(i)
            real += n
        else:
            out.append([i])
            real = n
    return out


def _prefill(model, prompts: list[list[int]], pad_id: int, device, waste: float | None):
    """KV cache, last logits (B, V) and attention mask (B, P) of every row, each distinct prompt run once."""
    distinct: dict[tuple, int] = {}
    where = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # row -> distinct prompt
    unique = [list(p) for p in distinct]
    parts = buckets([len(p) for p in unique], waste)
    caches, logits, masks = [], [], []
    for part in parts:
        ids, mask = left_pad([unique[i] for i in part], pad_id, device)  # (u, P_b)
        cache, last = _forward_last(model, ids, mask, device)
        if len(parts) > 1 and not _mergeable(cache):  # this cache keeps more than keys and values
            return _prefill(model, prompts, pad_id, device, None)
        caches.append(cache)
        logits.append(last)
        masks.append(mask)
    cache, width = caches[0], max(m.shape[1] for m in masks)
    if len(parts) > 1:  # left pad every bucket's keys and values to the longest, one cache
        for layer, *others in zip(cache.layers, *(c.layers for c in caches[1:])):
            for kind in ("keys", "values"):
                parts_kv = [getattr(layer_b, kind) for layer_b in (layer, *others)]  # (u, H, P_b, D) each
                setattr(layer, kind, torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))
                                                for t in parts_kv]))
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in masks])  # (U, P)
    logits = torch.cat(logits)  # (U, V), in bucket order
    position = {i: k for k, i in enumerate(i for part in parts for i in part)}  # distinct prompt -> bucket row
    index = torch.tensor([position[w] for w in where], device=device)  # (B,)
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(index)
        return cache, logits[index], mask[index]
    ids, mask = left_pad(prompts, pad_id, device)  # a cache without row selection: prefill every row
    cache, last = _forward_last(model, ids, mask, device)
    return cache, last, mask


def _mergeable(cache) -> bool:
    """Whether bucket caches can be left padded into one: a plain DynamicCache of DynamicLayers
    (sliding-window, linear-attention or quantized layers keep other state: never padded)."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return False
    return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)


def _cache_keyword(model) -> str:
    """transformers >= 5.2x names the KV cache ``cache``; earlier releases ``past_key_values``. A PEFT model's
    forward takes ``**kwargs``: the base model's signature decides."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]
