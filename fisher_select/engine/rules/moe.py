"""Mixture-of-experts layers of transformers 5: fused 3-D experts and their top-k routers.

Both see the batch flattened to (B*T, d) token rows (``flat_tokens``), so the engine hands them
the pass's B and a token row r belongs to sample ``r // T``.

Experts (``MixtralExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``, ``GptOssExperts``) hold every
expert's weights in one 3-D parameter, expert e at index e of dim 0, and are called as
``experts(x, top_k_index, top_k_weights)``. Token t routed to expert e with weight w adds
``w * f_e(x_t)`` to its output Y, so ``f_e``'s output gradient at t is ``w * dY_t``. Per expert,
the rule recomputes the up projection ``z = x W_up (+ b)`` of its routed tokens, the gate
(``module._apply_gate``: gate and up as concatenated halves, or gpt-oss's interleaved and clamped
pairs) and the down projection, then rebuilds each sample's gradient as the Linear rule does,
``dW = sum over the sample's routed tokens of dOut_t^T In_t`` (transposed layouts: ``In_t^T
dOut_t``; biases: ``sum_t dOut_t``). The layout comes from the flags transformers'
``use_experts_implementation`` sets on the instance (``is_transposed``, ``has_bias``,
``has_gate``), so the eager, ``batched_mm`` and ``grouped_mm`` forwards get the same rule. The
cost is that of the experts' own forward and backward plus one padded batched GEMM per expert.

Routers (``*TopKRouter``) hold a bare ``weight`` (gpt-oss: and ``bias``) and return
``(logits, scores, indices)``; only the scores reach the log-probability (they weight the expert
outputs), so the rule takes the scores' gradient and differentiates the router's own forward per
sample (``torch.func``: one vector-Jacobian product per sample, batched with ``vmap``), which is
exact whatever the softmax / top-k / renormalisation order of the family.

Only these classes are registered (by module path, imported when a model holds a layer of that
model file). transformers 4.x kept experts as ``nn.Linear`` on flattened tokens: the engine
refuses any dense rule whose module sees other than B rows (``scoring._forward_hook``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fisher_select.engine.rules.base import Contribution, Rule, Summed, samples_per_block
from fisher_select.engine.rules.registry import Lazy, register
from fisher_select.errors import FisherSelectError

# model file -> class-name prefix, for the four MoE families of transformers 5
FAMILIES = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe", "gpt_oss": "GptOss"}


def _classes(kind: str) -> list[Lazy]:
    return [Lazy(f"transformers.models.{m}.modeling_{m}", f"{prefix}{kind}") for m, prefix in FAMILIES.items()]


@dataclass
class Routed:
    """What an experts call keeps: token rows, their routing, and the pass's batch size."""

    x: torch.Tensor  # (N, d) with N = B*T token rows
    index: torch.Tensor  # (N, k) chosen expert per row and choice
    weights: torch.Tensor  # (N, k) routing weight of each choice
    batch: int

    @property
    def length(self) -> int:
        return self.x.shape[0] // self.batch  # T


def _flat_rows(module: nn.Module, rows: int, batch: int) -> None:
    if batch <= 0 or rows % batch:
        raise FisherSelectError(f"{type(module).__name__} got {rows} token rows, not a multiple of the batch's "
                                f"{batch} samples: it is not called on the whole (B*T, d) batch as the MoE rules "
                                "expect; score this model with a transformers 5 MoE layout")


def _per_sample(sample: torch.Tensor, count: int, left: torch.Tensor, right: torch.Tensor | None) -> torch.Tensor:
    """Sums over each sample's tokens: of ``left_t^T right_t`` -> (count, a, c), or of ``left_t`` -> (count, a).

    ``sample``: (n,) sorted sample index (0..count-1) of each token row. The rows are padded to
    (count, L, .) with L the most tokens one sample sent, so one batched GEMM does every sample.
    """
    if right is None:
        return left.new_zeros(count, left.shape[1]).index_add_(0, sample, left)
    tokens = torch.bincount(sample, minlength=count)  # (count,)
    first = torch.cumsum(tokens, 0) - tokens
    rank = torch.arange(sample.numel(), device=sample.device) - first[sample]  # place within its sample
    length = int(tokens.max())
    lp = left.new_zeros(count, length, left.shape[1])
    rp = right.new_zeros(count, length, right.shape[1])
    lp[sample, rank] = left
    rp[sample, rank] = right
    return torch.bmm(lp.transpose(1, 2), rp)  # (count, a, c)


@register(*_classes("Experts"))
class FusedExpertsRule(Rule):
    flat_tokens = True

    @staticmethod
    def accepts(module) -> bool:
        # Layouts this rule models: transformers 5's flags; a post-expert norm or experts split over
        # ranks (expert parallel) changes what a call computes, so those go to the exact fallback.
        up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
        return (isinstance(getattr(module, "is_transposed", None), bool)
                and not getattr(module, "has_post_expert_norm", False)
                and not getattr(module, "_is_expert_parallel", False)
                and isinstance(getattr(module, up, None), torch.Tensor) and getattr(module, up).dim() == 3
                and isinstance(getattr(module, "down_proj", None), torch.Tensor))

    def capture(self, module, args, output, batch: int = 0):
        if len(args) < 3:
            raise FisherSelectError(f"{type(module).__name__} was called without positional (hidden_states, "
                                    "top_k_index, top_k_weights): the MoE rule cannot see the routing")
        x, index, weights = args[0], args[1], args[2]
        _flat_rows(module, x.shape[0], batch)
        return Routed(x.detach(), index.detach(), weights.detach(), batch)

    def routing(self, module, captured: Routed):
        return captured.index, module.num_experts

    def _names(self, module) -> tuple[str, str | None, str, str | None]:
        up = "gate_up_proj" if module.has_gate else "up_proj"
        bias = module.has_bias
        return up, (up + "_bias" if bias else None), "down_proj", ("down_proj_bias" if bias else None)

    def _factors(self, module, e: int, x: torch.Tensor, gy: torch.Tensor, dtype: torch.dtype) -> dict:
        """Expert e's per-token gradient factors: name -> (left, right) with ``dW = sum_t left_t^T right_t``,
        or (vector, None) for a bias. x: (n, d) routed rows, gy: (n, d) their weighted output gradient."""
        up, up_bias, down, down_bias = self._names(module)
        t = module.is_transposed  # stored (E, in, out) rather than nn.Linear's (E, out, in)
        w_up = getattr(module, up)[e].detach().to(dtype)
        w_down = getattr(module, down)[e].detach().to(dtype)
        with torch.enable_grad():  # hooks run inside backward, where grad mode is off
            z = x @ w_up if t else x @ w_up.T  # (n, 2I) or (n, I)
            if up_bias is not None:
                z = z + getattr(module, up_bias)[e].detach().to(dtype)
            z = z.detach().requires_grad_()
            h = module._apply_gate(z) if module.has_gate else module.act_fn(z)  # (n, I)
            dh = gy @ (w_down.T if t else w_down)  # (n, I)
            (dz,) = torch.autograd.grad(h, z, dh)  # (n, 2I)
        h = h.detach()
        out = {up: (x, dz) if t else (dz, x), down: (h, gy) if t else (gy, h)}
        if up_bias is not None:
            out[up_bias], out[down_bias] = (dz, None), (gy, None)
        return out

    def _experts(self, module, captured: Routed, grad_output: torch.Tensor, dtype: torch.dtype):
        """Per expert with routed tokens: (e, token sample indices (n,), factors)."""
        dy = grad_output.reshape(captured.x.shape[0], -1)  # (N, d)
        for e in range(module.num_experts):
            token, choice = (captured.index == e).nonzero(as_tuple=True)  # rows sorted: samples in order
            if token.numel() == 0:
                continue  # no token reached this expert: its gradient is zero for every sample
            x = captured.x[token].to(dtype)  # (n, d)
            gy = dy[token].to(dtype) * captured.weights[token, choice, None].to(dtype)  # (n, d)
            yield e, token // captured.length, self._factors(module, e, x, gy, dtype)

    def contributions(self, module, captured: Routed, grad_output, block, dtype):
        for e, sample, factors in self._experts(module, captured, grad_output, dtype):
            lo, hi = int(sample[0]), int(sample[-1]) + 1  # samples that sent tokens (others: zero)
            for name, (left, right) in factors.items():
                size = left.shape[1] * (1 if right is None else right.shape[1])  # one sample's gradient
                step = samples_per_block(hi - lo, size, block)
                for s in range(lo, hi, step):  # pieces of at most ``block`` elements (one sample at least)
                    ends = torch.tensor([s, s + step], device=sample.device)
                    rows = slice(*torch.searchsorted(sample, ends).tolist())  # these samples' token rows
                    if rows.start == rows.stop:
                        continue  # these samples sent this expert nothing: zero gradient
                    count = min(step, hi - s)
                    part = _per_sample(sample[rows] - s, count, left[rows], None if right is None else right[rows])
                    yield Contribution(name, s, part.unsqueeze(1), slice(e, e + 1))  # (b, 1, a, c) or (b, 1, a)

    def weighted_sum(self, module, captured: Routed, grad_output, weights, dtype):
        sums = {}
        for e, sample, factors in self._experts(module, captured, grad_output, dtype):
            w = weights.to(device=sample.device, dtype=dtype)[sample, None]  # (n, 1): each row's sample weight
            for name, (left, right) in factors.items():
                if name not in sums:
                    sums[name] = torch.zeros(getattr(module, name).shape, dtype=dtype, device=left.device)
                sums[name][e] = (w * left).sum(0) if right is None else (w * left).T @ right
        return [Summed(n, v) for n, v in sums.items()]


@register(*_classes("TopKRouter"))
class TopKRouterRule(Rule):
    flat_tokens = True

    @staticmethod
    def accepts(module) -> bool:
        names = {n for n, _ in module.named_parameters(recurse=False)}
        return "weight" in names and names <= {"weight", "bias"} and not any(True for _ in module.children())

    def capture(self, module, args, output, batch: int = 0):
        _flat_rows(module, args[0].reshape(-1, args[0].shape[-1]).shape[0], batch)
        return args[0].detach(), batch

    def graph_output(self, output):
        return output[1]  # (N, k) scores: the logits themselves reach no log-probability

    def with_graph_output(self, output, tensor):
        return (output[0], tensor, *output[2:])

    def contributions(self, module, captured, grad_output, block, dtype):
        x, batch = captured
        x = x.reshape(batch, -1, x.shape[-1])  # (B, T, d)
        ds = grad_output.reshape(batch, x.shape[1], -1)  # (B, T, k)
        params = {n: p.detach() for n, p in module.named_parameters(recurse=False)}

        def inner(p, x_n, ds_n):  # one sample: its T token rows
            scores = functional_call(module, p, (x_n,))[1]
            return (scores.to(dtype) * ds_n.to(dtype)).sum()

        per_sample = vmap(grad(inner), in_dims=(None, 0, 0))(params, x, ds)
        for name, value in per_sample.items():
            yield Contribution(name, 0, value.to(dtype))  # (B, *shape)
