"""The score engine: exact per-sample squared scores for every parameter in one backward.

Backprop of ``sum_n l_n`` hands every layer the per-sample output gradients ``dY_n`` (samples do
not interact), so each layer's rule (``rules/``) rebuilds sample n's own parameter gradient
``h_n`` from its captured input and ``dY_n``; the engine squares, weights and sums them in fp32.
Parameter ``.grad`` is never computed: covered parameters are frozen for the pass and the graph
is anchored at the first rule modules' outputs. Parameters no rule covers go to an exact
fallback (one backward per sample through the same graph), never skipped.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fisher_select.engine import rules
from fisher_select.engine.coverage import Coverage, _check_fallback, _restricted, plan_coverage
from fisher_select.engine.logprob import response_logprobs
from fisher_select.engine.routing import count_routes, not_per_sample
from fisher_select.engine.rules.base import Summed
from fisher_select.engine.sums import ScoreSums, _Shared, _Sums
from fisher_select.errors import FisherSelectError

# Also imported from here, where they lived before coverage.py and sums.py split off.
__all__ = ["DEFAULT_BLOCK", "Coverage", "ScoreSums", "plan_coverage", "score_sums", "_restricted", "_Sums"]

DEFAULT_BLOCK = 1 << 19  # elements in one dense per-sample piece (2 MiB fp32: stays in cache)


@contextmanager
def _frozen_for_pass(cov: Coverage):
    """Covered parameters need no .grad (rules rebuild per-sample grads); fallback ones do."""
    saved = {n: p.requires_grad for n, p in cov.params.items()}
    try:
        for n, p in cov.params.items():
            if p.is_floating_point():
                p.requires_grad_(n in cov.fallback)
        yield
    finally:
        for n, p in cov.params.items():
            p.requires_grad_(saved[n])


def _in_backward() -> bool:
    """True while autograd runs a backward (gradient-checkpoint recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _ModuleInfo:
    rule: rules.Rule
    full: dict[str, str]  # local parameter name -> full name (covered parameters only)
    calls: int = 0


class _Pass:
    """Hooks for one scoring pass; all state lives here, none on modules or parameters."""

    def __init__(self, cov: Coverage, sums: _Sums, block: int, dtype: torch.dtype = torch.float32, done=None, *,
                 batch: int):  # B: rules take dim 0 for the sample (MoE rules: B*T token rows), checked per call
        self.cov, self.sums, self.block, self.batch = cov, sums, block, batch
        self.dtype = dtype  # the rules hand over per-sample gradients in the accumulation dtype
        self.active = True
        self.done = done  # called with each parameter's name once its sums for this batch are complete
        self.pending: dict[str, int] = {}  # full name -> calls whose gradient has not arrived yet
        self.reported: set[str] = set()
        self.anchors: dict[tuple, torch.Tensor] = {}
        self.roots: list[torch.Tensor] = []  # module outputs that start the graph themselves
        self.calls: list[tuple[nn.Module, _ModuleInfo, object]] = []
        self.shared: dict[str, _Shared] = {}
        self.infos: dict[int, tuple[nn.Module, _ModuleInfo]] = {}
        for full, users in cov.users.items():
            for u in users:
                _, info = self.infos.setdefault(id(u.module), (u.module, _ModuleInfo(u.rule, {})))
                info.full[u.local] = full

    @contextmanager
    def hooks(self):
        handles = [m.register_forward_hook(self._forward_hook) for m, _ in self.infos.values()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _anchor(self, like: torch.Tensor) -> torch.Tensor:
        """A zero scalar requiring grad: adding it makes a frozen module's output part of the graph."""
        key = (like.dtype, like.device)
        if key not in self.anchors:
            self.anchors[key] = torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)
        return self.anchors[key]

    def _forward_hook(self, module, args, output):
        # Recomputation under gradient checkpointing runs inside backward: count each call once.
        if not self.active or _in_backward() or not torch.is_grad_enabled():
            return None
        _, info = self.infos[id(module)]
        rule = info.rule
        captured = rule.capture(module, args, output, batch=self.batch) if rule.flat_tokens else \
            rule.capture(module, args, output)
        tensor, replaced = rule.graph_output(output), None
        if not rule.flat_tokens and tensor.shape[0] != self.batch:
            raise not_per_sample(module, tensor.shape[0], self.batch)
        if not tensor.requires_grad:
            tensor = tensor + self._anchor(tensor)
            replaced = rule.with_graph_output(output, tensor)
        elif tensor.grad_fn is None:  # already a graph root (e.g. enable_input_require_grads)
            self.roots.append(tensor)
        info.calls += 1
        self.calls.append((module, info, captured))
        tensor.register_hook(lambda g, m=module, i=info, c=captured: self._on_grad(m, i, c, g))
        return replaced

    def prepare_shared(self, batch: int) -> None:
        """After the forward: parameters reached by several calls need their parts summed first."""
        calls_of: dict[str, list] = {}
        for module, info, captured in self.calls:
            for full in info.full.values():
                calls_of.setdefault(full, []).append((module, info, captured))
        self.pending = {full: len(calls) for full, calls in calls_of.items()}
        for full, calls in calls_of.items():
            if len(calls) < 2:
                continue
            sparse = [(m, i, c) for m, i, c in calls if i.rule.sparse]
            support = None
            if len(calls) - len(sparse) <= 1:
                support = _joint_support([i.rule.support(m, c) for m, i, c in sparse], self.cov.shapes[full][0])
            self.shared[full] = _Shared(full, self.sums, self.cov.shapes[full], batch, support)

    def _on_grad(self, module, info: _ModuleInfo, captured, grad_output) -> None:
        if not self.active:  # the fallback's per-sample backwards run through the same graph
            return
        items = None
        weights = self.sums.single_weights(grad_output.device)
        if weights is not None:  # no squares, one weighted sum: a rule may have it as one GEMM
            items = info.rule.weighted_sum(module, captured, grad_output, weights, self.dtype)
        if items is None:
            items = info.rule.contributions(module, captured, grad_output, self.block, self.dtype)
        for c in items:
            full = info.full.get(c.param)
            if full is None:  # this parameter is the fallback's
                continue
            target = self.shared.get(full)
            if isinstance(c, Summed):
                (target or _Direct(self.sums, full)).add_summed(c.value)
            elif isinstance(c, rules.RowSparse):
                (target or _Direct(self.sums, full)).add_sparse(c.sample, c.row, c.value)
            else:
                (target or _Direct(self.sums, full)).add_dense(c.start, c.value, c.rows)
        if self.done is not None:  # the last call's gradient completes a parameter not shared by others
            for full in info.full.values():
                self.pending[full] -= 1
                if self.pending[full] == 0 and full not in self.shared:
                    self.report(full)

    def report(self, full: str) -> None:
        if self.done is not None and full not in self.reported:
            self.reported.add(full)
            self.done(full)


@dataclass
class _Direct:
    sums: _Sums
    name: str

    def add_dense(self, start, g, rows=None):
        self.sums.add_dense(self.name, start, g, rows)

    def add_sparse(self, sample, row, value):
        self.sums.add_sparse(self.name, sample, row, value)

    def add_summed(self, value):
        self.sums.add_summed(self.name, value)


def _joint_support(supports, rows: int):
    """Union of (sample, row) pairs, sorted by key sample*rows+row."""
    keys = torch.unique(torch.cat([s * rows + r for s, r in supports]))
    return keys // rows, keys % rows


def score_sums(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
    signal: torch.Tensor | None = None, *, token_weights: torch.Tensor | None = None, block: int = DEFAULT_BLOCK,
    coverage: Coverage | None = None, into: ScoreSums | None = None, squares: bool = True, totals: bool = True,
    params: "set[str] | None" = None, accumulate_on: torch.device | str | None = None,
    accumulate_dtype: torch.dtype = torch.float32, done=None, compile: bool = False,
) -> ScoreSums:
    """Exact sums over the batch of per-sample scores, their squares and signal-weighted scores.

    input_ids, attention_mask, response_mask: (B, T); ``response_mask[b, t]`` is True where token
    t is a response token whose log-probability counts (position 0 never is). Rows may be left
    padded; positions are counted from each row's first real token. ``signal``: (B,) weights a_n, or (O, B) for O objectives at once (then ``.signal`` values have
    a leading O axis).
    ``token_weights``: (B, T) optional per-token weights w (then h_n is the gradient of
    ``sum_t w_t log pi(y_t | s_t)``). Keys are ``model.named_parameters()`` names, tied once.
    The model's mode (eval/train) is left as it is; calibrate() uses eval mode. ``into``: add
    to these running sums instead of allocating new ones (same signal layout). ``squares=False``
    skips the squared scores (a gradient-only pass); ``.squares`` is then None.

    Memory modes (each accumulator is parameter-sized; see docs/SCALING.md "Devices and memory modes"):
    ``totals=False`` keeps no score sums (``.total`` is None; F alone is ``squares=True,
    totals=False, signal=None``: 4 bytes per parameter in fp32). ``params``: names (as
    ``named_parameters()`` yields them) to accumulate for; other parameters get no
    accumulators, and layers holding none of them are not hooked (their per-sample gradients are
    never built). ``accumulate_on``: a device for the accumulators (``"cpu"``: host memory,
    pinned when CUDA is present); pieces are reduced on the parameter's device, then copied.
    ``accumulate_dtype``: the dtype of the per-sample gradients and the sums (float64 for
    exactness checks against ``engine.reference`` on a float64 model).

    ``done``: called with a parameter's name as soon as this batch's additions to its sums are
    complete (inside the backward, right after its module's last call got its gradient; tied or
    repeated parameters after their parts are joined, fallback ones after their loop), once per
    accumulated parameter, in the same order for the same model and batch layout. Sharded
    scoring (``engine.sharded``) reduce-scatters each layer's sums there and frees them.

    ``compile``: reduce each dense per-sample piece (Linear, Conv1D, norms) with one
    ``torch.compile``d kernel that reads it once for squares, score sums and signal sums
    (compiled on first use, once per process; same sums up to fp32 summation order).
    """
    batch = input_ids.shape[0]
    cov = _checked_coverage(model, response_mask, signal, batch, coverage, params)
    sums = _Sums(cov, signal, into, squares, accumulate_dtype, totals=totals, device=accumulate_on, batch=batch,
                 compiled=compile)
    run = _Pass(cov, sums, block, accumulate_dtype, done, batch=batch)
    routes = ScoreSums(None, None, None, 0)  # holds the routing counts when not adding to ``into``
    _backward(model, (input_ids, attention_mask, response_mask, token_weights), run, into if into is not None else routes)
    weighted = sums.signal
    if weighted is not None and signal is not None and signal.dim() == 1:
        weighted = {n: v[0] for n, v in weighted.items()}
    if into is not None:
        into.count += batch
        return into
    return ScoreSums(sums.squares, weighted, sums.total, batch, routes.expert_tokens, routes.expert_positions)


def _checked_coverage(model: nn.Module, response_mask, signal, batch: int, coverage, params) -> Coverage:
    """The coverage of the parameters asked for, after every check that can run before the forward."""
    if response_mask[:, 0].any():
        raise FisherSelectError("response_mask[:, 0] must be False: the first token has no log-probability")
    if signal is not None and (signal.dim() not in (1, 2) or signal.shape[-1] != batch):
        raise FisherSelectError(f"signal must have shape ({batch},) or (objectives, {batch}), got {tuple(signal.shape)}")
    cov = _restricted(coverage or plan_coverage(model), params)
    _check_fallback(cov)
    rules.check_model(model)
    return cov


def _backward(model: nn.Module, batch: tuple, run: _Pass, routes: ScoreSums) -> None:
    """One forward with the pass's hooks, one backward feeding the rules, then the fallback's per-sample loop.

    batch: (input_ids, attention_mask, response_mask, token_weights), (B, T) each (token_weights may be None).
    """
    input_ids, attention_mask, response_mask, token_weights = batch
    cov, sums = run.cov, run.sums
    with _frozen_for_pass(cov), run.hooks():
        logp = response_logprobs(model, input_ids, attention_mask, response_mask, token_weights)  # (B,)
        run.prepare_shared(input_ids.shape[0])
        count_routes(model, run.calls, attention_mask, response_mask, routes)
        _check_checkpointing(model, run)
        fallback = list(cov.fallback.items())
        inputs = list(run.anchors.values()) + run.roots + [p for _, p in fallback]
        if not inputs:
            raise FisherSelectError("nothing in the model takes part in the log-probability graph")
        torch.autograd.grad(logp.sum(), inputs, retain_graph=bool(fallback), allow_unused=True)
        for name, shared in run.shared.items():
            shared.finish(run.block)
            run.report(name)
        run.active = False
        _fallback_loop(logp, fallback, sums)
        for name in cov.shapes:  # fallback parameters, and any whose layer got no gradient
            run.report(name)


def _fallback_loop(logp: torch.Tensor, fallback: list, sums: _Sums) -> None:
    """Exact per-sample gradients for parameters no rule covers: one backward per sample."""
    if not fallback:
        return
    params = [p for _, p in fallback]
    for n in range(logp.shape[0]):
        grads = torch.autograd.grad(logp[n], params, retain_graph=n < logp.shape[0] - 1, allow_unused=True)
        for (name, p), g in zip(fallback, grads):
            g = torch.zeros_like(p, dtype=sums.dtype) if g is None else g.to(sums.dtype)
            sums.add_dense(name, n, g.unsqueeze(0))



def _check_checkpointing(model: nn.Module, run: _Pass) -> None:
    """Reentrant checkpointing runs layers under no_grad, so hooks never see them: refuse."""
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    if not getattr(model, flag, False):
        return
    silent = [m for m, info in run.infos.values() if info.calls == 0]
    if silent:
        raise FisherSelectError(
            "gradient checkpointing hides layers from the score engine (reentrant mode); enable it with "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
            "or disable it for calibration"
        )
