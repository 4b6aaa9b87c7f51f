"""A cheap check of the rules against autograd, for every accumulator mode.

``check_rules`` scores the first ``rows`` rows of a batch with the engine (squares, and with a
signal the signal-weighted sums through the same paths a calibration uses) and compares each
rule-covered parameter's sums with those built from plain autograd, one backward per row. A
rule that does not model its module's computation (a subclass computing something else and
registered by mistake, a parameter used outside the module holding it) shows up as a parameter
whose sums disagree; the check raises one error naming every such parameter, its module and its
rule. It needs no score sums, so it runs whatever the accumulators (``full``, ``gradient``,
``fisher``) and whatever ``params`` restricts them to.

``rule_names`` lists which rule covers each parameter ("fallback": the exact per-sample
backward), for the report's coverage list.
"""

from __future__ import annotations

import torch
from torch import nn

from fisher_select.engine.logprob import response_logprobs
from fisher_select.engine.scoring import Coverage, _restricted, plan_coverage, score_sums
from fisher_select.errors import FisherSelectError

FALLBACK = "fallback"
# Relative error allowed per parameter, ||engine - autograd|| / (||engine|| + ||autograd||): fp32 sums of
# products of a few rows differ from autograd's only in rounding (about 1e-6 here); a rule that misses a
# factor or a term is off by order 1. Half-precision models round every activation: 5e-2.
DEFAULT_GROUP = 1 << 28  # elements checked per pass: bounds the check's memory on a large model (~3 GiB in fp32)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def rule_names(cov: Coverage) -> dict[str, str]:
    """Each parameter's rule (its class name, e.g. "LinearRule") or "fallback", by ``named_parameters()`` name."""
    out = {n: type(users[0].rule).__name__ for n, users in cov.users.items()}
    out.update({n: FALLBACK for n in cov.fallback})
    return {n: out[n] for n in cov.shapes}


def check_rules(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_mask: torch.Tensor, *, rows: int = 2, params: "set[str] | None" = None,
                signal: torch.Tensor | None = None, coverage: Coverage | None = None,
                group_elements: int = DEFAULT_GROUP) -> dict:
    """Compare the engine's per-sample sums with autograd on the first ``rows`` rows; raise if any differ.

    input_ids, attention_mask, response_mask: (B, T) as ``score_sums`` takes them. ``params``: check
    only these parameters (the calibration's ``params``/``modules``). ``signal``: (B,) or (O, B),
    then ``sum_n a_n h_n`` is checked too (a (B,) signal through the rules' one-GEMM
    ``weighted_sum`` path, as a squares-free pass runs it). Parameters on the fallback are autograd
    already and are not compared; packed ones (4-bit weights: no autograd gradient) neither.

    Cost, per group of checked parameters of at most ``group_elements`` elements (one group for
    models up to that size): one engine pass on ``rows`` rows (two with a signal), one forward and
    ``rows`` backwards with parameter gradients; memory: the group's gradients and two fp32 sums
    of its size (three with a signal), besides the ``rows`` rows' activations. The model's mode is left as it is: run it as the calibration runs (eval mode, so
    no dropout makes the passes differ). Tolerance: ``TOLERANCE`` by the parameters' dtype.
    Returns ``{"rows", "parameters", "max_relative_error", "parameter", "tolerance", "unchecked"}``.
    """
    if _sharded(model):
        raise FisherSelectError("check_rules compares with plain autograd, which reaches FSDP's all-gathered "
                                "weights, not its shards: call it on the model before fully_shard "
                                "(calibration.fsdp.wrap); the sharded engine runs the same rules")
    cov = _restricted(coverage or plan_coverage(model), params)
    checked = [n for n, p in cov.params.items()
               if n in cov.users and p.is_floating_point() and tuple(p.shape) == cov.shapes[n]]
    unchecked = sorted(n for n in cov.users if n not in checked)
    rows = max(1, min(rows, input_ids.shape[0]))
    batch = tuple(t[:rows] for t in (input_ids, attention_mask, response_mask))  # (rows, T) each
    signal = None if signal is None else signal[..., :rows]  # (rows,) or (O, rows)
    dtype = torch.float64 if any(cov.params[n].dtype == torch.float64 for n in checked) else torch.float32
    if not checked:
        return {"rows": rows, "parameters": 0, "max_relative_error": 0.0, "parameter": None,
                "tolerance": None, "unchecked": unchecked}
    errors = {}
    for group in _groups(checked, cov, group_elements):
        grads = _autograd_sums(model, batch, {n: cov.params[n] for n in group}, signal, dtype)
        engine = _engine_sums(model, batch, cov, set(group), signal, dtype)
        errors.update({n: max(_rel(engine[k][n], grads[k][n]) for k in engine) for n in group})
        del grads, engine
    tol = max(TOLERANCE.get(cov.params[n].dtype, 1e-3) for n in checked)  # the least precise dtype decides
    bad = sorted((n for n, e in errors.items() if e > tol), key=lambda n: -errors[n])
    if bad:
        raise FisherSelectError(_mismatch(model, cov, bad, errors, tol, rows))
    worst = max(checked, key=lambda n: errors[n])
    return {"rows": rows, "parameters": len(checked), "max_relative_error": errors[worst], "parameter": worst,
            "tolerance": tol, "unchecked": unchecked}


def _groups(names: list[str], cov: Coverage, limit: int) -> list[list[str]]:
    """``names`` in order, cut into groups of at most ``limit`` elements (a larger parameter alone)."""
    out, size = [[]], 0
    for n in names:
        numel = cov.params[n].numel()
        if out[-1] and size + numel > limit:
            out.append([])
            size = 0
        out[-1].append(n)
        size += numel
    return out


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _engine_sums(model, batch, cov, names, signal, dtype) -> dict[str, dict[str, torch.Tensor]]:
    """{"squares": sum_n h_n**2, and with a signal "signal": sum_n a_n h_n (O, *shape)} from the engine."""
    kw = {"coverage": cov, "params": names, "accumulate_dtype": dtype, "totals": False}
    out = {"squares": score_sums(model, *batch, **kw).squares}
    if signal is not None:  # squares-free, as a gradient-only pass: a (rows,) signal takes weighted_sum
        sums = score_sums(model, *batch, signal, squares=False, **kw)
        out["signal"] = {n: v.reshape(-1, *cov.shapes[n]) for n, v in sums.signal.items()}
    return out


def _autograd_sums(model, batch, params: dict, signal, dtype) -> dict[str, dict[str, torch.Tensor]]:
    """The same sums from plain autograd: one forward, one backward per row."""
    saved = {n: p.requires_grad for n, p in params.items()}
    a = None if signal is None else signal.reshape(-1, signal.shape[-1]).to(dtype)  # (O, rows)
    squares = {n: torch.zeros(p.shape, dtype=dtype, device=p.device) for n, p in params.items()}
    weighted = None if a is None else {n: torch.zeros(len(a), *p.shape, dtype=dtype, device=p.device)
                                       for n, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        logp = response_logprobs(model, *batch)  # (rows,)
        for row in range(logp.shape[0]):
            grads = torch.autograd.grad(logp[row], list(params.values()), retain_graph=row < logp.shape[0] - 1,
                                        allow_unused=True)
            for (n, p), g in zip(params.items(), grads):
                g = torch.zeros_like(p, dtype=dtype) if g is None else g.to(dtype)
                squares[n].add_(g * g)
                if weighted is not None:  # (O, *shape) += a[:, row] * g
                    weighted[n].add_(a[:, row].to(g.device).view(-1, *[1] * g.dim()) * g)
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])
    return {"squares": squares} if weighted is None else {"squares": squares, "signal": weighted}


def _rel(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """||mine - ref|| / (||mine|| + ||ref||): symmetric, 0 when both are 0, at most 1 unless signs flip."""
    mine, ref = mine.double(), ref.to(mine.device).double()
    return float((mine - ref).norm() / (mine.norm() + ref.norm() + 1e-300))


def _mismatch(model, cov: Coverage, bad: list[str], errors: dict, tol: float, rows: int) -> str:
    """One message naming every disagreeing parameter with its module, class and rule."""
    module_names = {id(m): name for name, m in model.named_modules()}
    parts = []
    for n in bad[:8]:
        user = cov.users[n][0]
        parts.append(f"{n} (module {module_names.get(id(user.module), '?')!r}, class {type(user.module).__name__}, "
                     f"rule {type(user.rule).__name__}: relative error {errors[n]:.2e})")
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    return (f"the engine's per-sample sums disagree with autograd on the first {rows} rows (tolerance {tol:g}) for "
            f"{'; '.join(parts)}{more}: the rule does not model what these modules compute (a subclass or a "
            "parameter used outside its module); register a rule for the class (fisher_select.engine.rules."
            "register) or report this model")
