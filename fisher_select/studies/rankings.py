"""The rankings ``validate`` scores against realized movement: the run's and every baseline's entry.

Each ranking is scored on the same subsample of coordinates (``Reduced``: the subsample and module
sums) against the main run's moved sets, with the same metrics: AUROC, precision/recall@k,
Jaccard@k, and the Spearman correlation of module aggregates with module movement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fisher_select.stats.correlation import spearman
from fisher_select.stats.naming import module_of
from fisher_select.studies import baselines
from fisher_select.studies.metrics import (QUANTILES, Realized, Subsample, auroc, moved_mask, ranking_metrics,
                                            selection_metrics)

CURVE_FRACTIONS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)


@dataclass
class Reduced:
    """A parameter-shaped quantity reduced to what the metrics use: the subsample and module sums."""

    sub: torch.Tensor  # (M,) fp32
    modules: dict[str, float]  # module -> sum over its coordinates (fp64)


def reduce(tensors: dict[str, torch.Tensor], sub: Subsample, transform=None) -> Reduced:
    """Subsample values and per-module sums of ``transform(tensor)`` (default: the tensor)."""
    modules: dict[str, float] = {}
    values = {}
    for name, t in tensors.items():
        v = t if transform is None else transform(t)
        values[name] = v
        modules[module_of(name)] = modules.get(module_of(name), 0.0) + float(v.double().sum())
    return Reduced(sub.take(values), modules)


def auroc_by_step(scores: torch.Tensor, by_step: list[torch.Tensor]) -> dict:
    """The ranking's AUROC against the movement after each step (moved: above the q-quantile)."""
    return {"meaning": "AUROC of the run's ranking for 'moved more than the q-quantile' against the "
                       "movement after steps 1..N of the main run (how the prediction drifts with steps)",
            **{f"q{q}": [auroc(scores, moved_mask(m, q)) if float(m.max()) > 0 else None for m in by_step]
               for q in QUANTILES}}


@dataclass
class Rankings:
    """Scores rankings against the main run's movement; collects each one's overlap curve in ``curves``."""

    sub: Subsample
    realized: Realized  # the main run's moved sets
    moved: Reduced  # the main run's movement
    seed: int  # of the metrics' random draws
    curves: dict = field(default_factory=dict)  # label -> overlap curve (the plots)

    @property
    def modules(self) -> list[str]:
        return sorted(self.moved.modules)

    @property
    def target(self) -> list[float]:
        return [self.moved.modules[m] for m in self.modules]

    def entry(self, scores: torch.Tensor, module_scores: dict, how: str, label: str) -> dict:
        metrics, self.curves[label] = ranking_metrics(scores, self.realized, self.seed + 1, CURVE_FRACTIONS)
        rho = spearman([module_scores.get(m, 0.0) for m in self.modules], self.target)
        entry = {"how": how, **metrics, "spearman_modules": rho}
        if scores.numel() and bool((scores == scores[0]).all()):  # e.g. a zero gradient: no ranking at all
            entry["degenerate"] = ("every score is equal (e.g. a batch without signal gives a zero gradient): this "
                                   "ranking is random tie-breaking, its metrics are chance by construction")
        return entry

    def baselines(self, theta0: dict, model, single: Reduced, second: dict | None) -> dict:
        """The baselines' rankings: random, |theta|, one batch's |grad|, Spectrum, KappaTune, a second seed."""
        sub, seed = self.sub, self.seed
        numel: dict[str, float] = {}
        for n, t in theta0.items():
            numel[module_of(n)] = numel.get(module_of(n), 0.0) + t.numel()
        out = {"random": self.entry(baselines.random_scores(sub.size, seed), numel,
                                    "uniform random scores (a random mask of the same density); module "
                                    "aggregate: module size", "random")}
        mag = reduce(theta0, sub, torch.abs)
        out["magnitude"] = self.entry(mag.sub, mag.modules, "|theta| at the start; module aggregate: sum of |theta|",
                                      "magnitude")
        out["single_batch_gradient"] = self.entry(
            single.sub, single.modules,
            "|gradient| of one training-size batch at the start (its own samples); module aggregate: sum",
            "single-batch |grad|")
        out["spectrum_snr"] = self.spectrum(model)
        out["kappa"] = self.kappa(model)
        if second is not None:
            out["second_seed"] = self.entry(second["moved"].sub, second["moved"].modules,
                                            f"realized |delta| of a second run with seed {second['seed']} "
                                            "(the ceiling: how well one run predicts another)", "second seed")
        else:
            out["second_seed"] = {"unavailable": "not run (second_seed=False)"}
        return out

    def spectrum(self, model) -> dict:
        names, modules, moved = self.sub.names, self.modules, self.moved
        snr = baselines.spectrum_module_scores(model)
        scores = self.sub.broadcast(baselines.per_parameter(names, snr, -1.0))
        entry = self.entry(scores, {m: snr.get(m, -1.0) for m in modules},
                           f"Spectrum's weight SNR per module ({baselines.SPECTRUM_SOURCE}); modules without a "
                           "weight score -1; coordinates get their module's score", "spectrum SNR")
        scored = [m for m in modules if m in snr]
        entry["spearman_modules_scored"] = spearman([snr[m] for m in scored], [moved.modules[m] for m in scored])
        chosen = baselines.spectrum_selection(snr)
        selected = self.sub.broadcast([float(module_of(n) in chosen) for n in names]) > 0
        entry["selection"] = {"rule": "top 50% per type + lm_head + embed_tokens", "modules": len(chosen),
                              **selection_metrics(selected, self.realized)}
        return entry

    def kappa(self, model) -> dict:
        names, modules, moved = self.sub.names, self.modules, self.moved
        scores, targets, how = baselines.kappa_module_scores(model)
        if scores is None:
            return {"unavailable": how}
        coords = self.sub.broadcast(baselines.per_parameter(names, scores, 0.0))
        entry = self.entry(coords, scores, f"KappaTune: lowest condition number first ({how}); modules it does "
                           "not analyse score 0", "kappa")
        scored = [m for m in modules if m in scores]
        entry["spearman_modules_scored"] = spearman([scores[m] for m in scored], [moved.modules[m] for m in scored])
        selected = self.sub.broadcast([float(module_of(n) in targets) for n in names]) > 0
        entry["selection"] = {"rule": f"find_kappa_target_modules(top_p={baselines.KAPPA_TOP_P})",
                              "modules": len(targets), **selection_metrics(selected, self.realized)}
        return entry

    def adam(self, adam: Reduced | None) -> dict:
        if adam is None:
            return {"status": "not computed (adam_aware=False)"}
        entry = self.entry(adam.sub, adam.modules,
                           "BEYOND THE SEED'S BOUND: per-coordinate signal-to-noise |m|/sqrt(m^2 + Var/B) of a "
                           "training-size minibatch gradient, from exact per-row sums on the first-step batch "
                           "(rows weighted by their signal); a heuristic for Adam, measured here",
                           "adam-aware SNR")
        entry["label"] = "beyond the seed's bound: ship only as far as it measurably predicts"
        return entry
