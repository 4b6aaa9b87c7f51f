"""The score engine's accumulators: ``ScoreSums`` (what a pass returns) and how per-sample pieces reach them.

Dense per-sample pieces are reduced over their samples while still in cache; sparse (row) pieces
are index-added; a parameter reached by several module calls is summed per sample before it is
squared (``_Shared``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fisher_select.engine.coverage import Coverage


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

