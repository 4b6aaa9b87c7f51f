"""Expert units of a mixture-of-experts model: fused expert tensors split into one slice per expert.

In transformers 5, Mixtral, Qwen3-MoE, OLMoE and gpt-oss keep the experts of one MoE layer as
fused parameters of one module named ``experts``, with the expert index as **dim 0** in every
family (the layouts differ only inside an expert's slice):

- Mixtral, Qwen3-MoE, OLMoE: ``gate_up_proj`` (E, 2I, d) (gate and up as halves), ``down_proj`` (E, d, I);
- gpt-oss: ``gate_up_proj`` (E, d, 2I) (transposed, gate and up interleaved), ``gate_up_proj_bias`` (E, 2I),
  ``down_proj`` (E, I, d), ``down_proj_bias`` (E, d).

So expert ``e`` of ``model.layers.0.mlp.experts.gate_up_proj`` is ``tensor[e]``, and the **expert
unit** ``model.layers.0.mlp.experts.3`` is the set of slices ``[3]`` of every fused tensor of that
module. A parameter is recognised as fused when its module's last name is ``experts``, it has at
least 2 dims, and every such parameter of the module has the same dim 0 (the number of experts;
with ``num_experts`` given, e.g. from ``num_experts_of(model.config)``, dim 0 must equal it).
Experts kept as separate modules (``experts.3.w1.weight``) are not fused: each is already a module.
The router (``mlp.gate.weight`` / ``mlp.router.weight``, (E, d)) is one module, not split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

EXPERTS_MODULE = "experts"  # the last name of the module holding fused expert tensors
CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # where configs keep E


@dataclass(frozen=True)
class FusedExperts:
    """One fused expert tensor: ``num_experts`` slices along dim 0."""

    param: str  # full parameter name, e.g. model.layers.0.mlp.experts.gate_up_proj
    shape: tuple[int, ...]  # (E, ...)

    @property
    def module(self) -> str:
        """The experts module, e.g. ``model.layers.0.mlp.experts``."""
        return self.param.rsplit(".", 1)[0]

    @property
    def leaf(self) -> str:
        """The parameter's own name inside the module, e.g. ``gate_up_proj``."""
        return self.param.rsplit(".", 1)[1]

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def slice_numel(self) -> int:
        """Coordinates of one expert's slice."""
        return math.prod(self.shape[1:])

    def unit(self, expert: int) -> str:
        """The expert unit's name: ``model.layers.0.mlp.experts.3``."""
        return f"{self.module}.{expert}"

    def slice_name(self, expert: int) -> str:
        """One expert's slice of this tensor: ``model.layers.0.mlp.experts.3.gate_up_proj``."""
        return f"{self.unit(expert)}.{self.leaf}"

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per expert, its slice of ``values`` (the tensor itself, or its row-major flattening): views."""
        if tuple(values.shape) == self.shape:
            return list(values.unbind(0))
        if values.dim() == 1 and values.numel() == math.prod(self.shape):
            return self.split_units(values)
        raise ValueError(f"{self.param}: values of shape {tuple(values.shape)} are neither {self.shape} nor flat")

    def split_units(self, units: torch.Tensor) -> list[torch.Tensor]:
        """Per expert, its contiguous share of a 1-D vector of units in row-major order over dim 0 first
        (coordinates, or the rows of an (E, X) tensor): views."""
        if units.dim() != 1 or units.numel() % self.num_experts:
            raise ValueError(f"{self.param}: {tuple(units.shape)} units do not split into {self.num_experts} experts")
        return list(units.view(self.num_experts, -1).unbind(0))


def num_experts_of(config) -> int | None:
    """The number of routed experts a model config states (None for a dense model or an unknown key)."""
    for key in CONFIG_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def fused_experts(shapes: Mapping[str, Sequence[int]], num_experts: int | None = None) -> dict[str, FusedExperts]:
    """Parameter name -> ``FusedExperts`` for every fused expert tensor among ``shapes`` (name -> shape).

    See the module docstring for the rule. A module named ``experts`` whose tensors disagree on
    dim 0 (or disagree with ``num_experts``) is not fused: its tensors stay whole.
    """
    by_module: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        module, _, _ = name.rpartition(".")
        if module.rpartition(".")[2] == EXPERTS_MODULE and len(shape) >= 2:
            by_module.setdefault(module, []).append((name, tuple(int(s) for s in shape)))
    found = {}
    for members in by_module.values():
        heads = {shape[0] for _, shape in members}
        (e,) = heads if len(heads) == 1 else (None,)
        if e is None or e < 2 or (num_experts is not None and e != num_experts):
            continue
        found.update((name, FusedExperts(name, shape)) for name, shape in members)
    return dict(sorted(found.items()))


def fused_experts_of(model) -> dict[str, FusedExperts]:
    """``fused_experts`` over a model's parameters, E checked against its config."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return fused_experts(shapes, num_experts_of(getattr(model, "config", None)))


def experts_by_module(fused: Mapping[str, FusedExperts]) -> dict[str, list[FusedExperts]]:
    """Experts module -> its fused tensors (sorted by name)."""
    out: dict[str, list[FusedExperts]] = {}
    for name in sorted(fused):
        out.setdefault(fused[name].module, []).append(fused[name])
    return out


def expert_masses(fisher: Mapping[str, torch.Tensor], tensors: Sequence[FusedExperts]) -> tuple[list[float], list[float]]:
    """(bound mass sum sqrt(F), Fisher mass sum F) per expert, over the given fused tensors of one module.

    fp64 sums; negative F (rounding of a difference) counts as 0, as everywhere in the bound.
    """
    num = {t.num_experts for t in tensors}
    if len(num) != 1:
        raise ValueError(f"fused tensors {[t.param for t in tensors]} disagree on the number of experts")
    e = num.pop()
    bound, fisher_mass = torch.zeros(e, dtype=torch.float64), torch.zeros(e, dtype=torch.float64)
    for t in tensors:
        f = fisher[t.param].detach().to(torch.float64).clamp_min(0).reshape(e, -1)  # (E, slice)
        bound += f.sqrt().sum(1)
        fisher_mass += f.sum(1)
    return bound.tolist(), fisher_mass.tolist()
