"""The bound maths that an in-memory ``Calibration`` and a loaded ``Run`` share, and module masses.

- ``coordinate_bound``: ``sqrt(F_i * S)`` per coordinate;
- ``BoundsView``: objective lookup, Fisher choice and bounds over ``fisher`` / ``token_fisher`` /
  ``objectives`` (inherited by ``calibration.calibrator.Calibration`` and ``run.load.Run``);
- ``module_masses``: the one place per-module masses are summed. Two masses, never confused: the
  **Fisher mass** (sum of F, dominated by a few huge coordinates) and the **bound mass** (sum of
  sqrt(F): the sum of the module's bounds up to the objective's constant sqrt(S)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.stats.naming import module_of


def coordinate_bound(fisher: dict[str, torch.Tensor], scale: float | None) -> dict[str, torch.Tensor]:
    """``sqrt(F_i * S)`` per coordinate; ``sqrt(F_i)`` when S is unknown (None)."""
    root = math.sqrt(scale) if scale is not None else 1.0  # inf when S is infinite: no bound
    # F_i = 0 means h_i = 0 on every response, so g_i = 0 whatever S is (avoid 0 * inf).
    return {name: torch.where(f > 0, f.sqrt() * root, 0.0) for name, f in fisher.items()}


@dataclass
class ModuleMass:
    """One module's sums over its coordinates (fp64, exactly rounded over its parameters)."""

    name: str
    numel: int = 0
    fisher_mass: float = 0.0  # sum of F
    bound_mass: float = 0.0  # sum of sqrt(F)
    root_max: float = 0.0  # the largest sqrt(F_i) (0 for a module without coordinates)
    parameters: list[str] = field(default_factory=list)  # in the order they came


def module_masses(fisher: dict[str, torch.Tensor]) -> dict[str, ModuleMass]:
    """Module -> its ``ModuleMass``, modules in order of first appearance (``stats.naming.module_of``).

    Each parameter's sums are taken in fp64; a module's are ``math.fsum`` of its parameters' (exact:
    independent of the order the parameters come in, memory vs file). Negative F (rounding) counts as 0
    under the square root.
    """
    parts: dict[str, tuple[list[float], list[float]]] = {}
    out: dict[str, ModuleMass] = {}
    for name, f in fisher.items():
        mod = module_of(name)
        entry = out.setdefault(mod, ModuleMass(mod))
        fisher_parts, bound_parts = parts.setdefault(mod, ([], []))
        # one fp64 copy (a copy even of fp64 F), turned into sqrt(F) in place: 8 bytes per coordinate at most
        values = f.detach().to(torch.float64, copy=True)
        entry.numel += f.numel()
        fisher_parts.append(float(values.sum()))
        root = values.clamp_(min=0).sqrt_()
        bound_parts.append(float(root.sum()))
        entry.root_max = max(entry.root_max, float(root.max()) if f.numel() else 0.0)
        entry.parameters.append(name)
    for mod, (fisher_parts, bound_parts) in parts.items():
        out[mod].fisher_mass, out[mod].bound_mass = math.fsum(fisher_parts), math.fsum(bound_parts)
    return out


class BoundsView:
    """Objective lookup, Fisher choice and bounds over ``self.fisher``, ``self.token_fisher`` and
    ``self.objectives`` (entries with ``name``, ``signal_scale`` and ``token_level``)."""

    fisher: dict[str, torch.Tensor]
    token_fisher: dict[str, torch.Tensor] | None
    objectives: list

    def describe_source(self) -> str:
        return "this calibration"

    def objective(self, name: str | None = None):
        """The entry of objective ``name`` (default: the primary, first, one)."""
        for entry in self.objectives:
            if name is None or entry.name == name:
                return entry
        names = ", ".join(e.name for e in self.objectives)
        raise FisherSelectError(f"{self.describe_source()} has no objective {name!r}; it has: {names}")

    @property
    def signal_scale(self) -> float | None:
        """S of the primary objective; None when unknown (e.g. SFT without a density)."""
        return self.objective(None).signal_scale

    def signal_scale_of(self, objective: str | None) -> float | None:
        return self.objective(objective).signal_scale

    def fisher_for(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """The Fisher an objective's bound uses: F^tok for token-level objectives, else F."""
        token = self.objective(objective).token_level and self.token_fisher is not None
        return self.token_fisher if token else self.fisher

    def bound(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """``sqrt(F_i * S)`` per coordinate for one objective (default: the primary one).

        When S is unknown the bound is only known up to the common factor ``sqrt(S)``; this
        returns ``sqrt(F)`` then (same ranking): check ``signal_scale`` before using absolute
        thresholds.
        """
        return coordinate_bound(self.fisher_for(objective), self.signal_scale_of(objective))

    def mixed_bound(self, weights: dict[str, float]) -> dict[str, torch.Tensor]:
        """``sum_o |c_o| sqrt(F^(o)_i S_o)`` for a weighted mix of objectives on the same samples.

        For sequence-level objectives F^(o) = F and this is ``sqrt(F_i) sum_o |c_o| sqrt(S_o)``
        (MATH.md); a token-level objective brings its own factor sqrt(F^tok_i S_tok).
        """
        out: dict[str, torch.Tensor] = {}
        for name, c in weights.items():
            if self.signal_scale_of(name) is None:
                raise FisherSelectError(f"objective {name!r} has an unknown signal scale; it cannot enter a mixed bound")
            for n, b in self.bound(name).items():
                out[n] = out[n] + abs(c) * b if n in out else abs(c) * b
        return out
