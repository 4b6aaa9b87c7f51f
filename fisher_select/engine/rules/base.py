"""What a rule is and what it returns.

Every rule has one signature: ``contributions(module, captured, grad_output, block)`` takes
what the forward hook kept of one module call (``captured``, from ``capture``) and the gradient
of the summed log-probabilities with respect to that call's output (``grad_output``, which is
per-sample because samples do not interact), and yields per-sample gradients of the module's
own parameters. The engine squares, weights and sums them in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

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
    value: torch.Tensor  # (b, *shape) or (b, len(rows), *shape[1:]), fp32
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
    value: torch.Tensor  # (M, d) fp32


class Rule:
    """Base class; subclasses implement ``contributions`` and may narrow ``accepts``."""

    #: True when contributions are ``RowSparse`` and ``support`` is implemented.
    sparse = False

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
        """What to keep from the forward call: by default the first positional input."""
        return args[0].detach()

    def contributions(
        self, module: nn.Module, captured, grad_output: torch.Tensor, block: int
    ) -> Iterator[Contribution | RowSparse]:
        """Per-sample gradients; ``block`` caps the elements of one dense per-sample block."""
        raise NotImplementedError

    def support(self, module: nn.Module, captured) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample, row) pairs a sparse rule will report, in the same order (sparse rules only)."""
        raise NotImplementedError


def samples_per_block(batch: int, per_sample: int, block: int) -> int:
    """How many samples fit in one dense block of at most ``block`` elements (at least one)."""
    return max(1, min(batch, block // max(1, per_sample)))


def blocks(batch: int, rows: int, row_size: int, block: int):
    """(sample slice, row slice) pieces of a (batch, rows, row_size) per-sample tensor.

    Each piece holds at most ``block`` elements (at least one row of one sample), so squaring
    and summing it happens while it is still in cache, not in a second pass over memory.
    """
    per_sample = rows * row_size
    if per_sample <= block:
        step = samples_per_block(batch, per_sample, block)
        for start in range(0, batch, step):
            yield slice(start, min(batch, start + step)), None
        return
    row_step = max(1, block // max(1, row_size))
    for n in range(batch):
        for r in range(0, rows, row_step):
            yield slice(n, n + 1), slice(r, min(rows, r + row_step))


def as_3d(t: torch.Tensor) -> torch.Tensor:
    """(B, ..., d) -> (B, positions, d) in fp32: positions are everything between batch and features."""
    return t.reshape(t.shape[0], -1, t.shape[-1]).float()
