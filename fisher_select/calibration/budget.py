"""Memory estimated before any work: a calibration that cannot fit is refused with its numbers, not
OOM-killed after minutes of sampling.

The estimate adds what grows with the settings beside the loaded weights:

- accumulators: fp32 copies of the covered parameters, by memory mode (``engine.memory``): squares, one
  signal sum per objective (not with ``accumulators=fisher``), score sums (``full`` only), half A's squares
  (``stability``); on the device unless ``accumulate_on=cpu`` moves them to host memory;
- sampling: the KV cache of one sampling call (rows x (prompt + max_new_tokens) tokens) and the fp32
  logits of one decoding step (rows x vocabulary x 4 bytes, twice: log-softmax and its exp);
- scoring: the activations one scoring pass keeps for its backward, log-softmax included: the tokens of
  one pass (a batch's rows x tokens, capped by the token budget of ``engine.batching``) times the
  engine's own per-token estimate (``engine.batching.bytes_per_token``).

It is an estimate (kernels' workspaces and the allocator's slack are not in it), meant to refuse what
clearly cannot fit. ``FISHER_SELECT_MEMORY_LIMIT`` (bytes) caps the memory taken as available, for tests
and for leaving room to other jobs on a shared machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from fisher_select.engine.batching import bytes_per_token
from fisher_select.engine.memory import MemoryMode
from fisher_select.errors import FisherSelectError

MEMORY_LIMIT_ENV = "FISHER_SELECT_MEMORY_LIMIT"
SAMPLE_ROWS = 1024  # the most rows one sampling call draws when K exceeds the batch size (fixed: same draws anywhere)
SHRINK_FLAGS = ("--max-batch-tokens or --batch-size (fewer tokens per scoring pass), --accumulators gradient or "
                "fisher, --accumulate-on cpu, "
                "--no-stability, --max-new-tokens, or fewer --samples-per-prompt / --num-prompts")


def sampling_rows(batch_rows: int, batch_size: int) -> int:
    """Rows of one sampling call: the whole batch (K <= batch size: unchanged draws), else chunks of at most
    max(batch_size, SAMPLE_ROWS) rows, so that a huge K is drawn in bounded memory."""
    return min(batch_rows, max(batch_size, SAMPLE_ROWS))


@dataclass
class MemoryEstimate:
    """Bytes each part of a calibration needs; ``weights`` are loaded already."""

    weights: int
    accumulators: int  # on the device (0 when accumulate_on=cpu moves them to the host of a GPU)
    sampling: int
    scoring: int
    detail: str  # the sizes the parts come from, for the refusal

    @property
    def work(self) -> int:
        """What the calibration adds to the loaded model (the sampling and scoring peaks do not overlap)."""
        return self.accumulators + max(self.sampling, self.scoring)


def _config_sizes(model) -> tuple[int, int, int, int]:
    """(layers, hidden, KV width per token and layer, vocabulary) from the model's config (1 when unknown)."""
    cfg = getattr(model, "config", None)
    layers = int(getattr(cfg, "num_hidden_layers", None) or 1)
    hidden = int(getattr(cfg, "hidden_size", None) or 1)
    heads = int(getattr(cfg, "num_attention_heads", None) or 1)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads or 1)
    vocab = int(getattr(cfg, "vocab_size", None) or 1)
    return layers, hidden, kv_heads * head_dim, vocab


def accumulator_copies(memory: MemoryMode, objectives: int, stability: bool) -> int:
    """Parameter-sized fp32 accumulators a calibration keeps in this memory mode."""
    return 1 + (objectives if memory.signals else 0) + int(memory.totals) + int(stability)


def estimate_memory(model, memory: MemoryMode, covered: int, *, objectives: int, stability: bool,
                    sample_rows: int, score_rows: int, tokens: int, max_tokens: int | None = None) -> MemoryEstimate:
    """The estimate for ``covered`` accumulated parameter coordinates, calls of ``sample_rows`` and
    ``score_rows`` rows, sequences of ``tokens`` (longest prompt + max_new_tokens), scoring passes of
    at most ``max_tokens`` tokens (the token budget; one row at least)."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    dtype_bytes = next((p.element_size() for p in params if p.is_floating_point()), 4)
    layers, _, kv, vocab = _config_sizes(model)
    copies = accumulator_copies(memory, objectives, stability)
    on_host = memory.device == "cpu" and next(iter(params)).device.type != "cpu"
    accumulators = 0 if on_host else 4 * covered * copies
    sampling = sample_rows * tokens * layers * 2 * kv * dtype_bytes + 2 * sample_rows * vocab * 4
    rows = score_rows if max_tokens is None else max(1, min(score_rows, max_tokens // tokens))  # as micro_batches
    per_pass = rows * tokens
    scoring = per_pass * bytes_per_token(model)
    detail = (f"accumulators {gib(accumulators)} ({copies} fp32 copies of {covered:,} coordinates"
              f"{', in host memory' if on_host else ''}), sampling {gib(sampling)} ({sample_rows} rows x {tokens} "
              f"tokens of KV cache + fp32 logits over {vocab:,} tokens), scoring {gib(scoring)} ({per_pass:,} tokens "
              f"per pass)")
    return MemoryEstimate(weights, accumulators, sampling, scoring, detail)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes free for the calibration, where the number comes from); None when it cannot be known."""
    free, source = _device_free(device)
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    if limit is None:
        return free, source
    try:
        capped = int(float(limit))
    except ValueError:
        raise FisherSelectError(f"{MEMORY_LIMIT_ENV}={limit!r} is not a number of bytes; set it to e.g. "
                                "8e9, or unset it") from None
    if free is None or capped < free:
        return capped, f"{MEMORY_LIMIT_ENV}"
    return free, source


def _device_free(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    try:
        import psutil
    except ImportError:
        free, source = _meminfo_available(), "MemAvailable in /proc/meminfo"
    else:
        free, source = psutil.virtual_memory().available, "available host memory (psutil)"
    room = _cgroup_room()  # a container's limit: the host's free memory does not see it, the OOM killer does
    if room is not None and (free is None or room < free):
        return room, "the container's memory.max less its memory.current"
    return free, source


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under a cgroup v2 memory limit; None without one."""
    try:
        limit = open(f"{root}/memory.max").read().strip()
        used = int(open(f"{root}/memory.current").read())
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - used) if limit.isdigit() else None


def _meminfo_available() -> int | None:
    try:
        text = open("/proc/meminfo").read()
    except OSError:  # not Linux: no check rather than a guess
        return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def check_memory(estimate: MemoryEstimate, device: torch.device) -> None:
    """Refuse, with the numbers and the flags that shrink it, a calibration that clearly cannot fit."""
    free, source = available_memory(device)
    if free is None or estimate.work <= free:
        return
    raise FisherSelectError(
        f"this calibration needs about {gib(estimate.work)} beside the {gib(estimate.weights)} of loaded weights "
        f"({estimate.detail}) but only {gib(free)} is available on {device} ({source}); "
        f"shrink it with {SHRINK_FLAGS}")
