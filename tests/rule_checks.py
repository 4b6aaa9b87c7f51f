"""Shared checks for the per-rule test files: float64 exactness against the brute-force references.

``assert_exact_f64`` runs ``score_sums`` on a float64 model with float64 accumulation and compares
squares, totals and signal sums (a 1-D signal and an (O, B) one) with
``fisher_select.engine.reference.brute_force_sums`` (one unpadded backward per row) at relative
error 1e-10, on a batch with left-padded rows. ``rule_vs_autograd`` checks one rule in isolation:
its per-sample gradients against one ``autograd.grad`` per sample of ``sum(module(x_n) * dy_n)``.
"""

from __future__ import annotations

import torch
from torch import nn

from fisher_select import score_sums
from fisher_select.engine.reference import brute_force_sums, per_sample_scores
from fisher_select.engine.rules import RowSparse
from tests.tiny import random_batch

EXACT = 1e-10  # float64 engine vs float64 per-sample loop: only summation order differs
ROW_BLOCK = 64  # a dense block smaller than one per-sample weight (16 x 16): pieces of a few rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-300))


def _compare(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        assert got[name].dtype == torch.float64, (what, name)
        assert got[name].shape == value.shape, (what, name)
        assert rel(got[name], value) <= EXACT, (what, name, rel(got[name], value))


def assert_exact_f64(model: nn.Module, block: int = 1 << 19, vocab: int = 64) -> None:
    """score_sums(float64) == brute force (float64) for squares, totals, 1-D and (O, B) signals."""
    model = model.double()
    ids, attn, resp, signal = random_batch(vocab=vocab)  # rows 1 and 2 are left padded
    assert not attn.all()
    sums = score_sums(model, ids, attn, resp, signal, block=block, accumulate_dtype=torch.float64)
    squares, weighted, total = brute_force_sums(model, ids, attn, resp, signal)
    assert sums.count == ids.shape[0]
    _compare(sums.squares, squares, "squares")
    _compare(sums.total, total, "total")
    _compare(sums.signal, weighted, "signal")
    # (O, B): every objective row against the same per-sample gradients; fp32 signal, as calibrate passes it.
    several = torch.stack([signal, signal.flip(0) * 2 - 1])
    both = score_sums(model, ids, attn, resp, several, block=block, squares=False, accumulate_dtype=torch.float64)
    assert both.squares is None
    scores = per_sample_scores(model, ids, attn, resp)
    for o, row in enumerate(several):
        want = {n: sum(float(a) * s[n] for a, s in zip(row, scores)) for n in scores[0]}
        _compare({n: v[o] for n, v in both.signal.items()}, want, f"signal row {o}")


def rule_vs_autograd(rule, module: nn.Module, x: torch.Tensor, block: int = 1 << 19) -> None:
    """The rule's per-sample gradients equal autograd's, sample by sample (float64)."""
    module = module.double()
    x = x.double() if x.is_floating_point() else x  # (B, ..., d), or token ids
    with torch.no_grad():
        dy = torch.randn_like(module(x))  # (B, ..., out): any per-sample output gradient
    params = dict(module.named_parameters(recurse=False))
    got = {n: torch.zeros(x.shape[0], *p.shape, dtype=torch.float64) for n, p in params.items()}
    captured = rule.capture(module, (x,), None)
    for c in rule.contributions(module, captured, dy, block, torch.float64):
        assert c.value.dtype == torch.float64
        if isinstance(c, RowSparse):
            got[c.param].index_put_((c.sample, c.row), c.value, accumulate=True)
        else:
            rows = c.rows if c.rows is not None else slice(None)
            got[c.param][c.start : c.stop, rows] += c.value
    for n in range(x.shape[0]):
        out = module(x[n : n + 1])
        grads = torch.autograd.grad((out * dy[n : n + 1]).sum(), list(params.values()))
        for (name, _), g in zip(params.items(), grads):
            assert rel(got[name][n], g) <= EXACT, (name, n, rel(got[name][n], g))


def replace_norms(model: nn.Module, make) -> nn.Module:
    """Swap every model-specific ``*RMSNorm`` (LlamaRMSNorm, ...) for ``make(old)``, weights copied."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm") and not isinstance(child, nn.RMSNorm):
                new = make(child)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                setattr(parent, child_name, new)
    return model


def torch_rms_norm(old: nn.Module) -> nn.RMSNorm:
    """torch's own RMSNorm with the same eps: the same function as LlamaRMSNorm, in the input dtype."""
    return nn.RMSNorm(old.weight.shape, eps=old.variance_epsilon)


class ShiftedNorm(nn.Module):
    """A model-specific norm no rule registers by class: Gemma-style ``(1 + w)`` scale plus a bias.

    Its name ends in "Norm", so the functional norm rule covers it by differentiating its forward.
    """

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, d))

    def forward(self, x):  # (..., d)
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x_hat * (1 + self.weight) + self.bias


def shifted_norm(old: nn.Module) -> ShiftedNorm:
    return ShiftedNorm(old.weight.shape[0], old.variance_epsilon)
