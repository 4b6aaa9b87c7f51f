"""Token-budget micro-batches: score a batch in pieces of at most ``max_tokens`` rows x padded length.

At long responses one forward+backward over the whole batch is memory-bound (its activations
leave the caches, on a GPU they may not fit at all), and a per-sample loop beats it. Samples do
not interact and every accumulator is a sum over samples, so scoring the rows in any partition
into the same running sums gives the same sums, up to fp32 summation order. A row's signal and
token weights travel with it: they are computed (per prompt group, for centred objectives)
before scoring, so a group split across micro-batches scores exactly as a whole one.
"""

from __future__ import annotations

import torch
from torch import nn

from fisher_select.engine.scoring import ScoreSums, score_sums

# Activation bytes one micro-batch may hold when ``max_tokens`` is "auto" (None). CPU: the
# 135M default measured ~2 MB per token in fp32 and stopped gaining from wider batches beyond
# ~1-1.5k tokens (bench/results/sweep-length.txt); GPUs have room and bandwidth for more.
ACTIVATION_BYTES = {"cuda": 16 << 30}
DEFAULT_ACTIVATION_BYTES = 2 << 30


def bytes_per_token(model: nn.Module) -> int:
    """Activation bytes one token keeps for the backward, estimated from the layer widths.

    Each linear-like layer keeps its output and the matching input (about 2 x out_features
    values; for a Llama layer that is ~18 x hidden), the log-softmax over the vocabulary two
    more vocabulary-sized rows. 135M default in fp32: 2.03 MB estimated, ~2.0 MB measured.
    """
    width = sum(getattr(m, "out_features", getattr(m, "nf", 0)) for m in model.modules())
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    elem = next(model.parameters()).element_size()
    return max(1, elem * 2 * (width + vocab))


def auto_max_tokens(model: nn.Module) -> int:
    """The default token budget: ``ACTIVATION_BYTES`` of the model's device over ``bytes_per_token``."""
    device = next(model.parameters()).device.type
    return max(1, ACTIVATION_BYTES.get(device, DEFAULT_ACTIVATION_BYTES) // bytes_per_token(model))


def micro_batches(attention_mask: torch.Tensor, max_tokens: int | None, max_rows: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted by length, longest first, cut greedily.

    A micro-batch's padded length is its longest row (its first), so it holds at most
    ``max_tokens // length`` rows (at least one: a row longer than the budget goes alone) and at
    most ``max_rows``. Sorting keeps rows of similar length together, so little is padding.
    """
    rows, width = attention_mask.shape
    first = (attention_mask != 0).long().argmax(1)  # (B,) first real column of each row
    lengths = (width - first).tolist()
    order = sorted(range(rows), key=lambda b: (-lengths[b], b))
    budget, limit = max_tokens or rows * width, max_rows or rows
    out: list[list[int]] = []
    for b in order:
        if out and len(out[-1]) < min(limit, max(1, budget // lengths[out[-1][0]])):
            out[-1].append(b)
        else:
            out.append([b])
    return out


def score_in_budget(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_mask: torch.Tensor, signal: torch.Tensor | None = None, *,
                    max_tokens: int | None, max_rows: int | None = None, token_weights: torch.Tensor | None = None,
                    into: ScoreSums | None = None, **kwargs) -> ScoreSums:
    """``score_sums`` over the batch in micro-batches of at most ``max_tokens`` rows x padded length.

    Same arguments as ``score_sums`` (``signal``: (B,) or (O, B); ``token_weights``: (B, T)),
    and the same sums up to fp32 summation order. A batch that fits (``max_tokens`` None: no
    budget) is one unchanged ``score_sums`` call. Otherwise each micro-batch is cut to the
    columns its rows use (left padding shared by all of them) and added ``into`` the running
    sums; ``done`` then fires once per micro-batch and parameter.
    """
    rows, width = input_ids.shape
    if (max_tokens is None or rows * width <= max_tokens) and (max_rows is None or rows <= max_rows):
        return score_sums(model, input_ids, attention_mask, response_mask, signal,
                          token_weights=token_weights, into=into, **kwargs)
    for part in micro_batches(attention_mask, max_tokens, max_rows):
        pick = torch.tensor(part, device=input_ids.device)  # (b,)
        mask = attention_mask.index_select(0, pick)  # (b, T)
        start = int(mask.any(0).nonzero()[0])  # leading columns that are padding in every row
        ids, resp = (t.index_select(0, pick)[:, start:] for t in (input_ids, response_mask))  # (b, T')
        sig = None if signal is None else signal.index_select(-1, pick.to(signal.device))  # (b,) or (O, b)
        weights = None if token_weights is None else token_weights.index_select(0, pick)[:, start:]
        into = score_sums(model, ids, mask[:, start:], resp, sig, token_weights=weights, into=into, **kwargs)
    return into
