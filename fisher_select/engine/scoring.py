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
from dataclasses import dataclass, field

import torch
from torch import nn

from fisher_select.engine import rules
from fisher_select.errors import FisherSelectError
from fisher_select.engine.logprob import response_logprobs
from fisher_select.engine.rules.bnb import check_layout

DEFAULT_BLOCK = 1 << 19  # elements in one dense per-sample piece (2 MiB fp32: stays in cache)


@dataclass
class ScoreSums:
    """Sums over the batch's samples n of per-sample scores h_n (fp32, parameter-shaped)."""

    squares: dict[str, torch.Tensor] | None  # sum_n h_n**2 (None when not asked for)
    signal: dict[str, torch.Tensor] | None  # sum_n a_n h_n, when a signal was given
    total: dict[str, torch.Tensor]  # sum_n h_n
    count: int  # B

    @classmethod
    def zeros(cls, cov: "Coverage", signals: int | None, squares: bool = True) -> "ScoreSums":
        """Empty sums to accumulate into; ``signals``: None, or the O of an (O, B) signal.

        Each accumulator lives on its parameter's device, so a model spread over several GPUs
        (``device_map="auto"``) accumulates where its per-sample gradients are computed.
        """
        def zeros(n, *lead):
            return torch.zeros(*lead, *cov.shapes[n], dtype=torch.float32, device=cov.params[n].device)

        signal = None if signals is None else {n: zeros(n, signals) for n in cov.shapes}
        sq = {n: zeros(n) for n in cov.shapes} if squares else None
        return cls(sq, signal, {n: zeros(n) for n in cov.shapes}, 0)


@dataclass
class _User:
    """One module holding a covered parameter directly."""

    module: nn.Module
    rule: rules.Rule
    local: str  # the parameter's name inside the module


@dataclass
class Coverage:
    """Which rule covers which parameter; the rest go to the exact fallback."""

    users: dict[str, list[_User]] = field(default_factory=dict)  # full name -> users
    fallback: dict[str, nn.Parameter] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    params: dict[str, nn.Parameter] = field(default_factory=dict)

    module_types: dict[str, str] = field(default_factory=dict)  # module name -> class name

    def summary(self) -> dict:
        by_rule: dict[str, int] = {}
        for users in self.users.values():
            key = type(users[0].rule).__name__
            by_rule[key] = by_rule.get(key, 0) + 1
        return {"rules": by_rule, "fallback": sorted(self.fallback), "module_types": self.module_types}


def plan_coverage(model: nn.Module) -> Coverage:
    """Assign every parameter (tied ones once) to rules or the fallback, checking nothing is left.

    A parameter is rule-covered only if every module holding it directly has a rule that accepts
    that module; otherwise all of its gradient comes from the exact fallback.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # first name wins (tied once)
    holders: dict[str, list[tuple[nn.Module, str]]] = {}
    cov = Coverage()
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            holders.setdefault(names[id(p)], []).append((module, local))
            cov.module_types.setdefault(module_name, type(module).__name__)
    for name, p in model.named_parameters():
        cov.params[name] = p
        users = []
        for module, local in holders[name]:
            rule = rules.lookup(module)
            if rule is None or not rule.accepts(module):
                users = None
                break
            users.append(_User(module, rule, local))
        if users:
            cov.users[name] = users
            cov.shapes[name] = users[0].rule.fisher_shape(users[0].module, users[0].local, p)
        else:
            cov.fallback[name] = p
            cov.shapes[name] = tuple(p.shape)
    missing = set(names.values()) - set(cov.shapes)
    if missing:  # cannot happen unless named_parameters is inconsistent; never skip silently
        raise FisherSelectError(f"parameters not covered by any rule or the fallback: {sorted(missing)[:5]}")
    return cov


class _Sums:
    """fp32 accumulators and the bookkeeping for parameters with several contributions."""

    def __init__(self, cov: Coverage, signal: torch.Tensor | None, into: ScoreSums | None, squares: bool = True):
        # a: (O, B) -- one row per objective; a 1-D signal is one objective. Dense pieces use it
        # as Python floats (no device sync per piece), sparse ones as a tensor on their device.
        self.a = signal.detach().float().reshape(-1, signal.shape[-1]) if signal is not None else None
        self.a_list = self.a.tolist() if self.a is not None else None
        self._a_on: dict = {}
        if into is not None:
            self.squares, self.total, self.signal = into.squares, into.total, into.signal
            if signal is not None and signal.dim() == 1:  # the caller's dicts have no O axis
                self.signal = {n: v.unsqueeze(0) for n, v in into.signal.items()}
            return
        fresh = ScoreSums.zeros(cov, None if self.a is None else len(self.a), squares)
        self.squares, self.total, self.signal = fresh.squares, fresh.total, fresh.signal
        self.shared: dict[str, _Shared] = {}

    def add_dense(self, name: str, start: int, g: torch.Tensor, rows: slice | None = None) -> None:
        """g: (b, *shape) per-sample gradients of samples start..start+b (only ``rows``, if given).

        One fused pass per sample (add, axpy, addcmul) while the piece is still in cache.
        """
        sq = self.squares[name] if self.squares is not None else None
        tot = self.total[name]
        sig = self.signal[name] if self.a is not None else None
        if rows is not None:
            tot = tot[rows]
            sq = sq[rows] if sq is not None else None
            sig = sig[:, rows] if sig is not None else None
        for i in range(g.shape[0]):
            gi = g[i]
            tot.add_(gi)
            if sq is not None:
                sq.addcmul_(gi, gi)
            if sig is not None:
                for o in range(sig.shape[0]):
                    sig[o].add_(gi, alpha=self.a_list[o][start + i])

    def a_at(self, device) -> torch.Tensor:
        """The (O, B) signal on ``device`` (copied once per device)."""
        if device not in self._a_on:
            self._a_on[device] = self.a.to(device)
        return self._a_on[device]

    def add_sparse(self, name: str, sample, row, value) -> None:
        """value: (M, d) gradients of sample[m] at row[m], (sample, row) pairs unique."""
        self.total[name].index_add_(0, row, value)
        if self.a is not None:
            self.signal[name].index_add_(1, row, self.a_at(sample.device)[:, sample, None] * value)  # (O, M, d)
        if self.squares is not None:
            self.squares[name].index_add_(0, row, value.square())


class _Shared:
    """A parameter reached by several module calls: square the per-sample *sum* of all parts.

    Tied embedding / output head (the common case): the dense head part is added at once and
    also kept only at the (sample, row) pairs the embedding part touches; at the end the square
    is corrected there: ``(D + E)^2 - D^2``. Any other sharing keeps the full per-sample sum.
    """

    def __init__(self, name: str, sums: _Sums, shape, batch: int, support):
        self.name, self.sums = name, sums
        self.support = support  # (sample, row) pairs of all sparse parts, or None (dense mode)
        if support is not None:
            sample, row = support
            self.dense_at = torch.zeros(sample.numel(), *shape[1:], device=sample.device)
            self.sparse_at = torch.zeros_like(self.dense_at)
            self.keys = sample * shape[0] + row  # sorted, unique
            self.rows = shape[0]
        else:
            self.full = torch.zeros(batch, *shape, device=sums.total[name].device)

    def add_dense(self, start: int, g: torch.Tensor, rows: slice | None = None) -> None:
        r0, r1 = (rows.start, rows.stop) if rows is not None else (0, g.shape[1])
        if self.support is None:
            self.full[start : start + g.shape[0], r0:r1].add_(g)
            return
        self.sums.add_dense(self.name, start, g, rows)
        sample, row = self.support
        sel = (sample >= start) & (sample < start + g.shape[0]) & (row >= r0) & (row < r1)
        self.dense_at[sel] += g[sample[sel] - start, row[sel] - r0]

    def add_sparse(self, sample, row, value) -> None:
        if self.support is None:
            self.full.index_put_((sample, row), value, accumulate=True)
            return
        where = torch.searchsorted(self.keys, sample * self.rows + row)
        self.sparse_at.index_add_(0, where, value)

    def finish(self) -> None:
        if self.support is None:
            self.sums.add_dense(self.name, 0, self.full)
            return
        sample, row = self.support
        d, e = self.dense_at, self.sparse_at
        s = self.sums
        s.total[self.name].index_add_(0, row, e)
        if s.a is not None:
            s.signal[self.name].index_add_(1, row, s.a_at(sample.device)[:, sample, None] * e)
        if s.squares is not None:
            s.squares[self.name].index_add_(0, row, (d + e).square() - d.square())


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

    def __init__(self, cov: Coverage, sums: _Sums, block: int):
        self.cov, self.sums, self.block = cov, sums, block
        self.active = True
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
        captured = info.rule.capture(module, args, output)
        replaced = None
        if not output.requires_grad:
            output = replaced = output + self._anchor(output)
        elif output.grad_fn is None:  # already a graph root (e.g. enable_input_require_grads)
            self.roots.append(output)
        info.calls += 1
        self.calls.append((module, info, captured))
        output.register_hook(lambda g, m=module, i=info, c=captured: self._on_grad(m, i, c, g))
        return replaced

    def prepare_shared(self, batch: int) -> None:
        """After the forward: parameters reached by several calls need their parts summed first."""
        calls_of: dict[str, list] = {}
        for module, info, captured in self.calls:
            for full in info.full.values():
                calls_of.setdefault(full, []).append((module, info, captured))
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
        for c in info.rule.contributions(module, captured, grad_output, self.block):
            full = info.full.get(c.param)
            if full is None:  # this parameter is the fallback's
                continue
            target = self.shared.get(full)
            if isinstance(c, rules.RowSparse):
                (target or _Direct(self.sums, full)).add_sparse(c.sample, c.row, c.value)
            else:
                (target or _Direct(self.sums, full)).add_dense(c.start, c.value, c.rows)


@dataclass
class _Direct:
    sums: _Sums
    name: str

    def add_dense(self, start, g, rows=None):
        self.sums.add_dense(self.name, start, g, rows)

    def add_sparse(self, sample, row, value):
        self.sums.add_sparse(self.name, sample, row, value)


def _joint_support(supports, rows: int):
    """Union of (sample, row) pairs, sorted by key sample*rows+row."""
    keys = torch.unique(torch.cat([s * rows + r for s, r in supports]))
    return keys // rows, keys % rows


def score_sums(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    signal: torch.Tensor | None = None,
    *,
    token_weights: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    coverage: Coverage | None = None,
    into: ScoreSums | None = None,
    squares: bool = True,
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
    """
    batch = input_ids.shape[0]
    if response_mask[:, 0].any():
        raise FisherSelectError("response_mask[:, 0] must be False: the first token has no log-probability")
    if signal is not None and (signal.dim() not in (1, 2) or signal.shape[-1] != batch):
        raise FisherSelectError(f"signal must have shape ({batch},) or (objectives, {batch}), got {tuple(signal.shape)}")
    cov = coverage or plan_coverage(model)
    check_layout(model)
    sums = _Sums(cov, signal, into, squares)
    run = _Pass(cov, sums, block)
    with _frozen_for_pass(cov), run.hooks():
        logp = response_logprobs(model, input_ids, attention_mask, response_mask, token_weights)  # (B,)
        run.prepare_shared(batch)
        _check_checkpointing(model, run)
        fallback = list(cov.fallback.items())
        inputs = list(run.anchors.values()) + run.roots + [p for _, p in fallback]
        if not inputs:
            raise FisherSelectError("nothing in the model takes part in the log-probability graph")
        torch.autograd.grad(logp.sum(), inputs, retain_graph=bool(fallback), allow_unused=True)
        for shared in run.shared.values():
            shared.finish()
        run.active = False
        _fallback_loop(logp, fallback, sums)
    weighted = sums.signal
    if weighted is not None and signal.dim() == 1:
        weighted = {n: v[0] for n, v in weighted.items()}
    if into is not None:
        into.count += batch
        return into
    return ScoreSums(sums.squares, weighted, sums.total, batch)


def _fallback_loop(logp: torch.Tensor, fallback: list, sums: _Sums) -> None:
    """Exact per-sample gradients for parameters no rule covers: one backward per sample."""
    if not fallback:
        return
    params = [p for _, p in fallback]
    for n in range(logp.shape[0]):
        grads = torch.autograd.grad(logp[n], params, retain_graph=n < logp.shape[0] - 1, allow_unused=True)
        for (name, p), g in zip(fallback, grads):
            g = torch.zeros_like(p, dtype=torch.float32) if g is None else g.float()
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
