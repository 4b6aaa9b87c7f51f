"""Parameter snapshots and realized movement ``|theta_T - theta_0|``, per coordinate, in fp32.

Snapshots are fp32 copies on the CPU keyed as ``named_parameters()`` yields them (tied
parameters once), the same keys as a run's Fisher. Movement is the difference of two fp32
tensors: small updates are only lost to the fp32 rounding of the weights themselves (about
6e-8 relative), never to a bf16 copy.
"""

from __future__ import annotations

import torch


def snapshot(model) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of every parameter."""
    return {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in model.named_parameters()}


@torch.no_grad()
def load_snapshot(model, saved: dict[str, torch.Tensor]) -> None:
    """Write a snapshot back into the model (and drop any gradient)."""
    for name, p in model.named_parameters():
        p.copy_(saved[name].to(p.device, p.dtype))
        p.grad = None


def movement(model, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``|theta_i - theta0_i|`` per coordinate (fp32, CPU), parameter-shaped."""
    lazy = LazyMovement(model, start)
    return {name: lazy[name] for name in start}


@torch.no_grad()
def gradients(model) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of every ``.grad`` (zeros where a parameter got none)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = torch.zeros(p.shape) if g is None else g.detach().to("cpu", torch.float32, copy=True)
    return out


@torch.no_grad()
def bf16_lost(model, start: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(coordinates that moved, of those the ones whose whole update a bf16 copy would lose).

    Lost: the start rounded to bf16, plus the realized fp32 update, rounds back to the same bf16
    value (the update is below half a bf16 spacing of the weight, about 2^-9 relative). A bf16
    training applies the update in steps, each smaller still, so this undercounts what it loses.
    """
    moved = lost = 0
    for name, p in model.named_parameters():
        delta = p.detach().to("cpu", torch.float32) - start[name]
        base = start[name].bfloat16()
        changed = delta != 0
        moved += int(changed.sum())
        lost += int((changed & ((base.float() + delta).bfloat16() == base)).sum())
    return moved, lost


class LazyMovement(dict):
    """``movement(model, start)`` computed one parameter at a time, when indexed (never all at once)."""

    def __init__(self, model, start: dict[str, torch.Tensor]):
        super().__init__()
        self.params, self.start = dict(model.named_parameters()), start

    @torch.no_grad()
    def __missing__(self, name: str) -> torch.Tensor:
        return (self.params[name].detach().to("cpu", torch.float32) - self.start[name]).abs()
