"""Measurements on the first-step batch of ``validate``: one SGD step with its noise level, and the
exact per-row sums behind the Adam-aware ranking (a training-size minibatch's signal-to-noise)."""

from __future__ import annotations

import math

import torch

from fisher_select.engine.scoring import plan_coverage, score_sums
from fisher_select.errors import FisherSelectError
from fisher_select.studies.loop import backward, pad_rows, token_weights
from fisher_select.studies.movement import gradients, load_snapshot, movement


def split_half_gradient(model, batch, pad: int, micro: int):
    """(the batch's mean loss gradient, an estimate of its noise, rows), parameter-keyed fp32 CPU tensors.

    The batch is split into two halves of whole prompt groups (groups are independent; rows inside
    one are not, through the leave-one-out baseline), with mean gradients g1 (n1 rows) and g2 (n2).
    The whole batch's mean is ``(n1 g1 + n2 g2) / (n1 + n2)``, of variance ``sigma^2 / (n1 + n2)``;
    ``|g1 - g2| sqrt(n1 n2) / (n1 + n2)`` has that same variance and zero mean: one draw of the noise.
    """
    half = len(batch.groups) // 2
    if half == 0:
        raise FisherSelectError("the first-step batch needs at least two prompt groups (it is split in halves)")
    grads, sizes = [], []
    for part in (batch.part(list(range(half))), batch.part(list(range(half, len(batch.groups))))):
        model.zero_grad(set_to_none=True)
        backward(model, part, pad, micro)
        grads.append(gradients(model))
        sizes.append(len(part.rows))
    model.zero_grad(set_to_none=True)
    n1, n2 = sizes
    mean = {k: (n1 * grads[0][k] + n2 * grads[1][k]) / (n1 + n2) for k in grads[0]}
    noise = {k: (grads[0][k] - grads[1][k]).abs() * (math.sqrt(n1 * n2) / (n1 + n2)) for k in grads[0]}
    return mean, noise, n1 + n2


def sgd_step(model, grad: dict, lr: float, start: dict) -> dict:
    """Take one plain SGD step along ``grad`` from ``start``; return ``|delta|`` (fp32) and restore ``start``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.grad = grad[name].to(p.device, p.dtype)
    torch.optim.SGD(list(model.parameters()), lr=lr).step()
    delta = movement(model, start)
    load_snapshot(model, start)
    return delta


def row_score_sums(model, batch, pad: int, micro: int):
    """Exact sums over the batch's rows of the per-row gradients ``u_n`` and of ``u_n^2`` (engine hooks).

    ``u_n`` is the gradient of row n's weighted log-probability ``sum_t w_{n,t} log pi(y_t|s_t)``:
    ``a_n h_n`` for a sequence-level signal, ``sum_t A_t h_t`` at token level, ``h_n`` for a
    demonstration (no weights). So ``total / count`` is the mean step direction (up to sign) and
    ``squares / count`` its per-row second moment.
    """
    cov, sums = plan_coverage(model), None
    device = next(model.parameters()).device
    for i in range(0, len(batch.rows), micro):
        rows = batch.rows[i : i + micro]
        ids, mask, resp = pad_rows(rows, pad, device)  # (B, T) each
        tw = None if batch.weights is None else token_weights(rows, batch.weights[i : i + micro], ids.shape[1], device)
        sums = score_sums(model, ids, mask, resp, token_weights=tw, coverage=cov, into=sums)
    return sums


def minibatch_snr(total: torch.Tensor, squares: torch.Tensor, count: int, rows: int,
                  population: int | None) -> torch.Tensor:
    """Per coordinate ``|m| / sqrt(m^2 + c Var / B)``: the signal-to-noise of a B-row minibatch gradient.

    ``m = total / count`` and ``Var = squares / count - m^2`` are the per-row mean and (plug-in)
    variance over ``count`` rows; ``B = rows`` rows per training step. Adam's step is about
    ``lr E[g_B] / sqrt(E[g_B^2])`` and ``E[g_B^2] = m^2 + c Var / B``. ``c`` is the finite-population
    correction ``(N - B) / (N - 1)`` when steps draw B of N rows without replacement (demonstrations;
    ``population`` = N), else 1. Coordinates with no gradient at all score 0. Same shape as ``total``.
    """
    c = 1.0 if population is None else max(population - rows, 0) / max(population - 1, 1)
    m = total.double() / count
    var = (squares.double() / count - m.square()).clamp_min(0)  # rounding can make it slightly negative
    denom = (m.square() + c * var / rows).sqrt()
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))  # 0/0 where nothing moved the coordinate
    return torch.where(denom > 0, m.abs() / safe, torch.zeros_like(denom)).float()
