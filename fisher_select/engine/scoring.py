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
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from fisher_select.engine import rules
from fisher_select.errors import FisherSelectError
from fisher_select.engine.logprob import response_logprobs
from fisher_select.engine.routing import count_routes, not_per_sample
from fisher_select.engine.rules.base import Summed

DEFAULT_BLOCK = 1 << 19  # elements in one dense per-sample piece (2 MiB fp32: stays in cache)


@dataclass
class ScoreSums:
    """Sums over the batch's samples n of per-sample scores h_n (parameter-shaped, fp32 by default).

    Each kind of sum exists only when asked for (``score_sums(squares=, totals=, signal=)``),
    and only for the parameters asked for (``params=``).
    """

    squares: dict[str, torch.Tensor] | None  # sum_n h_n**2 (None when not asked for)
    signal: dict[str, torch.Tensor] | None  # sum_n a_n h_n, when a signal was given
    total: dict[str, torch.Tensor] | None  # sum_n h_n (None when not asked for)
    count: int  # B
    # Per MoE experts module scored by a rule (module name -> (E,) int64), summed over batches:
    # how many sampled response tokens the router sent to each expert (each top-k choice counts),
    expert_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    # and how many real (non-padding) positions, prompt included: an expert none reached has F = 0.
    expert_positions: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def zeros(cls, cov: "Coverage", signals: int | None, squares: bool = True,
              dtype: torch.dtype = torch.float32, *, totals: bool = True,
              device: torch.device | str | None = None) -> "ScoreSums":
        """Empty sums to accumulate into; ``signals``: None, or the O of an (O, B) signal.

        Each accumulator lives on its parameter's device, so a model spread over several GPUs
        (``device_map="auto"``) accumulates where its per-sample gradients are computed, unless
        ``device`` says otherwise (``"cpu"``: host memory, pinned when CUDA is present, for
        models whose accumulators do not fit beside the weights).
        """
        pin = device is not None and torch.device(device).type == "cpu" and torch.cuda.is_available()

        def zeros(n, *lead):
            where = cov.params[n].device if device is None else device
            return torch.zeros(*lead, *cov.shapes[n], dtype=dtype, device=where, pin_memory=pin)

        signal = None if signals is None else {n: zeros(n, signals) for n in cov.shapes}
        sq = {n: zeros(n) for n in cov.shapes} if squares else None
        return cls(sq, signal, {n: zeros(n) for n in cov.shapes} if totals else None, 0)

    def nbytes(self) -> int:
        """Bytes held by the accumulators (what a memory mode costs)."""
        return sum(t.numel() * t.element_size() for d in (self.squares, self.signal, self.total) if d for t in d.values())


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
    # What the rules say about the model's modules, recorded so a run answers without the model:
    linear_like: list[str] = field(default_factory=list)  # module names LoRA can target
    embeddings: list[str] = field(default_factory=list)  # input embeddings and output head

    def summary(self) -> dict:
        by_rule: dict[str, int] = {}
        for users in self.users.values():
            key = type(users[0].rule).__name__
            by_rule[key] = by_rule.get(key, 0) + 1
        return {"rules": by_rule, "fallback": sorted(self.fallback), "module_types": self.module_types,
                "linear_like": self.linear_like, "embeddings": self.embeddings}


def plan_coverage(model: nn.Module) -> Coverage:
    """Assign every parameter (tied ones once) to rules or the fallback, checking nothing is left.

    A parameter is rule-covered only if every module holding it directly has a rule that accepts
    that module; otherwise all of its gradient comes from the exact fallback.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # first name wins (tied once)
    holders: dict[str, list[tuple[nn.Module, str]]] = {}
    cov = Coverage()
    heads = {id(m) for m in rules.embeddings_and_heads(model)}
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            holders.setdefault(names[id(p)], []).append((module, local))
            cov.module_types.setdefault(module_name, type(module).__name__)
        if rules.is_linear_like(module):
            cov.linear_like.append(module_name)
        if id(module) in heads:
            cov.embeddings.append(module_name)
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
            cov.shapes[name] = rules.fisher_shape(users[0].module, users[0].local, p)  # packed: logical
        else:
            cov.fallback[name] = p
            cov.shapes[name] = tuple(p.shape)  # autograd's gradient has the stored shape
    missing = set(names.values()) - set(cov.shapes)
    if missing:  # cannot happen unless named_parameters is inconsistent; never skip silently
        raise FisherSelectError(f"parameters not covered by any rule or the fallback: {sorted(missing)[:5]}")
    return cov


class _Sums:
    """The accumulators asked for, and how per-sample pieces reach them.

    A dense piece holds every sample's gradient of a range of rows (``rules.base.blocks``); it
    is reduced over its samples while still in cache and added once, so each accumulator is
    read and written once per batch, not once per sample.
    """

    def __init__(self, cov: Coverage, signal: torch.Tensor | None, into: ScoreSums | None, squares: bool = True,
                 dtype: torch.dtype = torch.float32, *, totals: bool = True, device=None, batch: int = 0,
                 compiled: bool = False):
        self.cov, self.dtype, self.batch = cov, dtype, batch
        self.compiled = compiled  # one fused kernel per dense piece (torch.compile), see _fused_reductions
        # a: (O, B) -- one row per objective; a 1-D signal is one objective.
        self.a = signal.detach().to(dtype).reshape(-1, signal.shape[-1]) if signal is not None else None
        self._weights_on: dict = {}
        # Accumulators placed elsewhere (accumulate_on=): reduce where the piece is, copy, add.
        self.copy = device is not None
        if into is not None:
            self.squares, self.total, self.signal = into.squares, into.total, into.signal
            if signal is not None and signal.dim() == 1:  # the caller's dicts have no O axis
                self.signal = {n: v.unsqueeze(0) for n, v in into.signal.items()}
            return
        fresh = ScoreSums.zeros(cov, None if self.a is None else len(self.a), squares, dtype, totals=totals,
                                device=device)
        self.squares, self.total, self.signal = fresh.squares, fresh.total, fresh.signal

    def compute_device(self, name: str) -> torch.device:
        return self.cov.params[name].device

    def _weights(self, device, dtype) -> torch.Tensor:
        """(K, B): a row of ones for the score sums (if kept), then the O signal rows."""
        key = (device, dtype)
        if key not in self._weights_on:
            rows = [] if self.total is None else [torch.ones(1, self.batch, dtype=dtype, device=device)]
            rows += [] if self.a is None else [self.a.to(device=device, dtype=dtype)]
            self._weights_on[key] = torch.cat(rows) if rows else None
        return self._weights_on[key]

    def _linear_targets(self, name: str, rows: slice | None) -> list[torch.Tensor]:
        """Flat (k, P) views of the accumulators that are linear in h: total, then signals."""
        out = []
        if self.total is not None:
            t = self.total[name] if rows is None else self.total[name][rows]
            out.append(t.view(1, -1))
        if self.a is not None:
            sig = self.signal[name] if rows is None else self.signal[name][:, rows]
            out.append(sig.view(sig.shape[0], -1))
        return out

    def _add(self, acc: torch.Tensor, value: torch.Tensor) -> None:
        acc.add_(value.to(acc.device) if self.copy or acc.device != value.device else value)

    def add_dense(self, name: str, start: int, g: torch.Tensor, rows: slice | None = None) -> None:
        """g: (b, *shape) per-sample gradients of samples start..start+b (only ``rows``, if given).

        Reduced over its b samples in cache: sum_n g_n and sum_n a_n g_n are one small GEMM
        (K, b) @ (b, P) with K = 1 + O; sum_n g_n**2 is one more pass. Then one add each.
        """
        flat = g.reshape(g.shape[0], -1)  # (b, P)
        weights = self._weights(g.device, g.dtype)
        if g.shape[0] == 1 and not self.compiled:
            self._add_one(name, flat[0], None if weights is None else weights[:, start : start + 1], rows)
            return
        if self.compiled:
            self._add_fused(name, flat, None if weights is None else weights[:, start : start + g.shape[0]], rows)
            return
        if weights is not None:
            reduced = torch.mm(weights[:, start : start + g.shape[0]], flat)  # (K, P)
            k = 0
            for target in self._linear_targets(name, rows):
                self._add(target, reduced[k : k + target.shape[0]])
                k += target.shape[0]
        if self.squares is not None:
            sq = self.squares[name] if rows is None else self.squares[name][rows]
            self._add(sq.view(-1), _sum_of_squares(flat))

    def _add_one(self, name: str, h: torch.Tensor, weights: torch.Tensor | None, rows: slice | None) -> None:
        """One sample's gradient h (P,) (weights (K, 1)): each sum takes it in one in-place pass, without the
        (K, P) product and the squares copy that a piece of several samples needs (fewer passes over memory)."""
        k = 0
        for target in self._linear_targets(name, rows):  # (n, P) each
            w = weights[k : k + target.shape[0]]  # (n, 1)
            if self.copy or target.device != h.device:
                self._add(target, w * h)
            else:
                target.addcmul_(w, h)
            k += target.shape[0]
        if self.squares is not None:
            sq = (self.squares[name] if rows is None else self.squares[name][rows]).view(-1)
            if self.copy or sq.device != h.device:
                self._add(sq, h * h)
            else:
                sq.addcmul_(h, h)

    def _add_fused(self, name: str, flat: torch.Tensor, weights: torch.Tensor | None, rows: slice | None) -> None:
        """add_dense's reductions in one compiled kernel: the (b, P) piece is read once, not once per sum."""
        sq, reduced = _fused_reductions(flat, weights, self.squares is not None)  # (P,) or None, (K, P) or None
        if reduced is not None:
            k = 0
            for target in self._linear_targets(name, rows):
                self._add(target, reduced[k : k + target.shape[0]])
                k += target.shape[0]
        if sq is not None:
            acc = self.squares[name] if rows is None else self.squares[name][rows]
            self._add(acc.view(-1), sq)

    def single_weights(self, device) -> torch.Tensor | None:
        """(B,): the one weighted sum a squares-free pass keeps (score sums, or one signal), else None."""
        if self.squares is not None:
            return None
        weights = self._weights(device, self.dtype)
        return weights[0] if weights is not None and weights.shape[0] == 1 else None

    def add_summed(self, name: str, value: torch.Tensor) -> None:
        """value: (*shape) = sum_n w_n h_n, straight from a rule's GEMM."""
        (target,) = self._linear_targets(name, None)  # (1, P)
        self._add(target, value.reshape(target.shape))

    def add_sparse(self, name: str, sample, row, value, squared: torch.Tensor | None = None) -> None:
        """value: (M, d) gradients of sample[m] at row[m], (sample, row) pairs unique.

        ``squared`` replaces ``value**2`` in the squares (the tied-embedding correction).
        """
        if self.total is not None:
            self._index_add(self.total[name], 0, row, value)
        if self.a is not None:
            a = self.a.to(device=sample.device, dtype=value.dtype)[:, sample, None]  # (O, M, 1)
            self._index_add(self.signal[name], 1, row, a * value)  # (O, M, d)
        if self.squares is not None:
            self._index_add(self.squares[name], 0, row, value.square() if squared is None else squared)

    def _index_add(self, acc: torch.Tensor, dim: int, row: torch.Tensor, value: torch.Tensor) -> None:
        if acc.device != value.device:
            row, value = row.to(acc.device), value.to(acc.device)
        acc.index_add_(dim, row, value)


def _reductions(flat: torch.Tensor, weights: torch.Tensor | None, squares: bool):
    """flat (b, P), weights (K, b) -> (sum_n flat_n**2 (P,), weights @ flat (K, P)), each None when not asked.

    Written as elementwise products and sums over n so inductor emits one loop over the piece
    computing every sum (a GEMM with K = 1 + O rows and a separate squares pass read it twice).
    """
    sq = (flat * flat).sum(0) if squares else None
    reduced = None if weights is None else (weights[:, :, None] * flat[None]).sum(1)
    return sq, reduced


_COMPILED = {}


def _fused_reductions(flat: torch.Tensor, weights: torch.Tensor | None, squares: bool):
    """``_reductions`` compiled once per process (dynamic shapes: one graph for every layer's piece)."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_reductions, dynamic=True)
    return _COMPILED["fn"](flat, weights, squares)


def _sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    """(b, P) -> (P,): sum over samples of squares, in one pass over the in-cache piece."""
    if flat.shape[0] == 1:
        return flat[0].square()
    return torch.linalg.vecdot(flat, flat, dim=0)  # on the contiguous (b, P) layout, not its .T


class _Shared:
    """A parameter reached by several module calls: square the per-sample *sum* of all parts.

    Tied embedding / output head (the common case): the dense head part is added at once and
    also kept only at the (sample, row) pairs the embedding part touches; at the end the square
    is corrected there: ``(D + E)^2 - D^2``. Any other sharing keeps the full per-sample sum.
    Without squares every sum is linear in h, so the parts go straight to the accumulators.
    """

    def __init__(self, name: str, sums: _Sums, shape, batch: int, support):
        self.name, self.sums = name, sums
        self.direct = sums.squares is None
        self.support = support  # (sample, row) pairs of all sparse parts, or None (dense mode)
        if self.direct:
            return
        device = sums.compute_device(name)
        if support is not None:
            sample, row = support
            self.dense_at = torch.zeros(sample.numel(), *shape[1:], dtype=sums.dtype, device=sample.device)
            self.sparse_at = torch.zeros_like(self.dense_at)
            self.keys = sample * shape[0] + row  # sorted, unique
            self.rows = shape[0]
        else:
            self.full = torch.zeros(batch, *shape, dtype=sums.dtype, device=device)  # (B, *shape)

    def add_dense(self, start: int, g: torch.Tensor, rows: slice | None = None) -> None:
        if self.direct:
            self.sums.add_dense(self.name, start, g, rows)
            return
        r0, r1 = (rows.start, rows.stop) if rows is not None else (0, g.shape[1])
        if self.support is None:
            self.full[start : start + g.shape[0], r0:r1].add_(g)
            return
        self.sums.add_dense(self.name, start, g, rows)
        sample, row = self.support
        sel = (sample >= start) & (sample < start + g.shape[0]) & (row >= r0) & (row < r1)
        self.dense_at[sel] += g[sample[sel] - start, row[sel] - r0]

    def add_summed(self, value: torch.Tensor) -> None:
        self.sums.add_summed(self.name, value)  # only without squares, where parts add linearly

    def add_sparse(self, sample, row, value) -> None:
        if self.direct:
            self.sums.add_sparse(self.name, sample, row, value)
        elif self.support is None:
            self.full.index_put_((sample, row), value, accumulate=True)
        else:
            where = torch.searchsorted(self.keys, sample * self.rows + row)
            self.sparse_at.index_add_(0, where, value)

    def finish(self, block: int) -> None:
        if self.direct:
            return
        if self.support is None:
            self._reduce_full(block)
            return
        sample, row = self.support
        d, e = self.dense_at, self.sparse_at
        self.sums.add_sparse(self.name, sample, row, e, squared=(d + e).square() - d.square())

    def _reduce_full(self, block: int) -> None:
        """Reduce the (B, *shape) per-sample sums a few rows at a time (each piece in cache)."""
        full = self.full
        if full.dim() == 1:  # a scalar parameter
            self.sums.add_dense(self.name, 0, full)
            return
        rows = full.shape[1]
        step = max(1, block // max(1, full[:, :1].numel()))
        for r in range(0, rows, step):
            part = slice(r, min(rows, r + step))
            self.sums.add_dense(self.name, 0, full[:, part], None if step >= rows else part)


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
    totals: bool = True,
    params: "set[str] | None" = None,
    accumulate_on: torch.device | str | None = None,
    accumulate_dtype: torch.dtype = torch.float32,
    done=None,
    compile: bool = False,
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

    Memory modes (each accumulator is parameter-sized; see README "Bigger models"):
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
    if response_mask[:, 0].any():
        raise FisherSelectError("response_mask[:, 0] must be False: the first token has no log-probability")
    if signal is not None and (signal.dim() not in (1, 2) or signal.shape[-1] != batch):
        raise FisherSelectError(f"signal must have shape ({batch},) or (objectives, {batch}), got {tuple(signal.shape)}")
    cov = _restricted(coverage or plan_coverage(model), params)
    _check_fallback(cov)
    rules.check_model(model)
    sums = _Sums(cov, signal, into, squares, accumulate_dtype, totals=totals, device=accumulate_on, batch=batch,
                 compiled=compile)
    run = _Pass(cov, sums, block, accumulate_dtype, done, batch=batch)
    routes = ScoreSums(None, None, None, 0)  # holds the routing counts when not adding to ``into``
    with _frozen_for_pass(cov), run.hooks():
        logp = response_logprobs(model, input_ids, attention_mask, response_mask, token_weights)  # (B,)
        run.prepare_shared(batch)
        count_routes(model, run.calls, attention_mask, response_mask, into if into is not None else routes)
        _check_checkpointing(model, run)
        fallback = list(cov.fallback.items())
        inputs = list(run.anchors.values()) + run.roots + [p for _, p in fallback]
        if not inputs:
            raise FisherSelectError("nothing in the model takes part in the log-probability graph")
        torch.autograd.grad(logp.sum(), inputs, retain_graph=bool(fallback), allow_unused=True)
        for name, shared in run.shared.items():
            shared.finish(block)
            run.report(name)
        run.active = False
        _fallback_loop(logp, fallback, sums)
        for name in cov.shapes:  # fallback parameters, and any whose layer got no gradient
            run.report(name)
    weighted = sums.signal
    if weighted is not None and signal is not None and signal.dim() == 1:
        weighted = {n: v[0] for n, v in weighted.items()}
    if into is not None:
        into.count += batch
        return into
    return ScoreSums(sums.squares, weighted, sums.total, batch, routes.expert_tokens, routes.expert_positions)


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


def _check_fallback(cov: Coverage) -> None:
    """The fallback differentiates with respect to the parameter: a packed (integer) one has no gradient."""
    packed = [n for n, p in cov.fallback.items() if not p.is_floating_point()]
    if packed:
        raise FisherSelectError(
            f"no rule covers {packed[:3]} ({len(packed)} in all) and they are stored packed (dtype "
            f"{cov.fallback[packed[0]].dtype}), so the exact per-sample fallback cannot differentiate them: a "
            "quantized layer whose class overrides its parent's forward needs a rule of its own "
            "(fisher_select.engine.rules.register), or leave these parameters out with params=")


def _restricted(cov: Coverage, params: "set[str] | None") -> Coverage:
    """The coverage of the chosen parameters only; the others stay frozen (``cov.params``)."""
    if params is None:
        return cov
    unknown = set(params) - set(cov.shapes)
    if unknown:
        raise FisherSelectError(f"params names no parameter of the model: {sorted(unknown)[:5]} "
                                "(use the names model.named_parameters() yields)")
    return replace(cov, users={n: u for n, u in cov.users.items() if n in params},
                   fallback={n: p for n, p in cov.fallback.items() if n in params},
                   shapes={n: s for n, s in cov.shapes.items() if n in params})


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
