"""What a rule is and what it returns.

Every rule has one signature: ``contributions(module, captured, grad_output, block, dtype)``
takes what the forward hook kept of one module call (``captured``, from ``capture``) and the
gradient of the summed log-probabilities with respect to that call's output (``grad_output``,
which is per-sample because samples do not interact), and yields per-sample gradients of the
module's own parameters in ``dtype`` (the engine's accumulation dtype: fp32 by default, float64
in the exactness tests). The engine squares, weights and sums them.

A rule also answers the layer questions the rest of the package asks through the registry
(``registry.py``): ``linear_like``, ``fisher_shape``, and the ``check`` / ``guard`` hooks that
keep a layer differentiable (bitsandbytes' CPU inference repacking).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, Iterator

import torch
from torch import nn


@dataclass
class Contribution:
    """Dense per-sample gradients of one parameter for samples ``start:stop``.

    ``rows``, when given, says the value covers only those rows (dim 0) of the parameter, so a
    large layer (an output head) can be processed in cache-sized pieces.
    """

    param: str  # local name in the module, e.g. "weight"
    start: int
    value: torch.Tensor  # (b, *shape) or (b, len(rows), *shape[1:]), in the requested dtype
    rows: slice | None = None

    @property
    def stop(self) -> int:
        return self.start + self.value.shape[0]


@dataclass
class RowSparse:
    """Per-sample gradients that are non-zero on a few rows (embeddings).

    Entry m is sample ``sample[m]``'s gradient at row ``row[m]``; (sample, row) pairs are unique.
    """

    param: str
    sample: torch.Tensor  # (M,) long
    row: torch.Tensor  # (M,) long
    value: torch.Tensor  # (M, d), in the requested dtype


@dataclass
class Summed:
    """``sum_n w_n h_n`` of one parameter over the whole batch (``Rule.weighted_sum``)."""

    param: str
    value: torch.Tensor  # (*shape), in the requested dtype


class Rule:
    """Base class; subclasses implement ``contributions`` and may narrow ``accepts``."""

    #: True when contributions are ``RowSparse`` and ``support`` is implemented.
    sparse = False
    #: True for layers computing ``X W^T + b`` with a 2-D (logical) weight: what LoRA can target.
    linear_like = False
    #: The methods whose computation the rule models: a subclass of the registered class that
    #: overrides one of them gets this rule only by being registered itself (``registry.lookup``).
    models: tuple[str, ...] = ("forward",)
    #: True for modules that see the batch flattened to (B*T, ...) token rows (MoE experts and
    #: routers): the engine then passes ``batch=B`` to ``capture``, so the rule can tell samples apart.
    flat_tokens = False

    @staticmethod
    def accepts(module: nn.Module) -> bool:
        """Whether this rule is exact for this particular instance (options it cannot handle)."""
        return True

    def param_names(self, module: nn.Module) -> list[str]:
        """Local names of the parameters this rule covers (those that exist)."""
        return [n for n, p in module.named_parameters(recurse=False) if p is not None]

    def fisher_shape(self, module: nn.Module, name: str, param: torch.Tensor) -> tuple[int, ...]:
        """Shape of the Fisher tensor for a parameter (its own shape unless stored packed)."""
        return tuple(param.shape)

    def capture(self, module: nn.Module, args: tuple, output: torch.Tensor):
        """What to keep from the forward call: by default the first positional input.

        Rules with ``flat_tokens`` also get the keyword ``batch`` (the pass's B).
        """
        return args[0].detach()

    def graph_output(self, output):
        """The output tensor whose gradient ``contributions`` takes (a module returning a tuple picks one)."""
        return output

    def with_graph_output(self, output, tensor: torch.Tensor):
        """``output`` with ``graph_output(output)`` replaced by ``tensor`` (the engine's graph anchor)."""
        return tensor

    def routing(self, module: nn.Module, captured) -> tuple[torch.Tensor, int] | None:
        """For MoE experts: ((B*T, k) expert index per token row and choice, number of experts), else None."""
        return None

    def contributions(
        self, module: nn.Module, captured, grad_output: torch.Tensor, block: int, dtype: torch.dtype
    ) -> Iterator[Contribution | RowSparse]:
        """Per-sample gradients in ``dtype``; ``block`` caps the elements of one dense per-sample block."""
        raise NotImplementedError

    def weighted_sum(
        self, module: nn.Module, captured, grad_output: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
    ) -> Iterator[Summed] | None:
        """``sum_n weights[n] h_n`` per parameter without per-sample gradients (weights: (B,)).

        For a pass that needs no squares and one weighted sum: one GEMM per layer, as a plain
        backward's weight gradient. None (the default): no such shortcut, the engine reduces
        the per-sample ``contributions`` instead.
        """
        return None

    def check(self, module: nn.Module) -> None:
        """Raise ``FisherSelectError`` if this instance cannot be differentiated in its current state."""

    def guard(self, module: nn.Module) -> ContextManager:
        """A context that keeps this instance differentiable while inference runs through it."""
        return nullcontext()

    def support(self, module: nn.Module, captured) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample, row) pairs a sparse rule will report, in the same order (sparse rules only)."""
        raise NotImplementedError


def samples_per_block(batch: int, per_sample: int, block: int) -> int:
    """How many samples fit in one dense block of at most ``block`` elements (at least one)."""
    return max(1, min(batch, block // max(1, per_sample)))


def blocks(batch: int, rows: int, row_size: int, block: int):
    """(sample slice, row slice) pieces of a (batch, rows, row_size) per-sample tensor.

    Each piece holds at most ``block`` elements (at least one row of one sample). Pieces run
    over the rows and hold every sample of their rows where that fits, so the engine reduces a
    piece over its samples while it is in cache and touches each accumulator row once per
    batch (an output head is so cut into vocabulary chunks). Only rows too long for all samples
    at once are split over samples as well.
    """
    per_row = batch * row_size
    if per_row <= block:
        row_step = min(rows, block // per_row)
        if row_step == rows:
            yield slice(0, batch), None
            return
        for r in range(0, rows, row_step):
            yield slice(0, batch), slice(r, min(rows, r + row_step))
        return
    step = samples_per_block(batch, row_size, block)
    for r in range(rows):
        for start in range(0, batch, step):
            yield slice(start, min(batch, start + step)), slice(r, r + 1)


def as_3d(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, ..., d) -> (B, positions, d) in ``dtype``: positions are everything between batch and features."""
    return t.reshape(t.shape[0], -1, t.shape[-1]).to(dtype)
