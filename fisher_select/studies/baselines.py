"""The rankings a fisher_select ranking is compared with, on the same numbers.

Coordinate rankings: a random one (a random mask of the same density), weight magnitude
``|theta|``, the gradient magnitude of one training batch at the start, the realized movement of
a second training run with another seed (the ceiling). Module-level rules of the peers:

- **Spectrum** (cognitivecomputations/spectrum, ``spectrum.py``, ``ModelModifier``,
  commit 0ed1756bc4a7920249860bcd0a32b551bcdf6d1f): per module weight W (a 1-D weight is
  unsqueezed to one row), singular values S = svdvals(W); sigma = IQR(S) / 1.349 (quartiles by
  ``torch.quantile``); Marchenko-Pastur threshold ``sigma * sqrt((1 + sqrt(beta))^2)`` with
  ``beta = n/m if n < m else m/n`` for W of shape (n, m); signal = sum of S above the threshold
  (0 if none), noise = sum of the rest (1 if none); score = (signal / noise) / S[0]. Spectrum
  then unfreezes the top ``top_percent`` (default 50) % of the modules of each type (the name
  after the layer index) by that score, plus ``lm_head`` and ``model.embed_tokens`` always.
  ``spectrum_snr`` reproduces the score exactly; ``spectrum_selection`` the selection rule
  (modules grouped by exact type name, where Spectrum matches type names as substrings; the same
  grouping for the usual decoder names).
- **KappaTune** (PEFT's ``find_kappa_target_modules``): the condition number
  ``S[0] / (S[-1] + 1e-8)`` of every ``nn.Linear`` weight with no dimension above 16384; the
  modules with the *lowest* condition numbers are the targets (``top_p`` = 0.2 by default).
  Used through PEFT's own functions when the installed PEFT has them.
"""

from __future__ import annotations

import numpy as np
import torch

from fisher_select.stats.naming import module_of

SPECTRUM_SOURCE = ("cognitivecomputations/spectrum spectrum.py (ModelModifier.calculate_snr_for_layer, "
                   "marchenko_pastur_threshold, estimate_sigma_with_full_iqr, generate_unfrozen_params_yaml), "
                   "commit 0ed1756bc4a7920249860bcd0a32b551bcdf6d1f")
SPECTRUM_ALWAYS = ("lm_head", "model.embed_tokens")  # unfrozen by Spectrum's YAML whatever their SNR
KAPPA_TOP_P = 0.2  # find_kappa_target_modules' default


def spectrum_snr(weight: torch.Tensor) -> float:
    """Spectrum's score of one weight matrix: (signal / noise) / largest singular value."""
    w = weight.detach().float()
    if w.ndim < 2:
        w = w.unsqueeze(0)
    s = torch.linalg.svdvals(w)  # descending
    sigma = (torch.quantile(s, 0.75) - torch.quantile(s, 0.25)) / 1.349
    n, m = w.shape[-2:]
    beta = n / m if n < m else m / n
    threshold = sigma * np.sqrt((1 + np.sqrt(beta)) ** 2)
    signal_mask = s > threshold
    signal = s[signal_mask].sum() if signal_mask.any() else torch.tensor(0.0)
    noise = s[~signal_mask].sum() if (~signal_mask).any() else torch.tensor(1.0)
    snr = signal / noise if noise != 0 else torch.tensor(float("inf"))
    return float(snr / s[0])


def spectrum_type(module_name: str) -> str:
    """Spectrum's weight type: the name after the first all-digit part (the layer index), else the name."""
    parts = module_name.split(".")
    index = next((i for i, p in enumerate(parts) if p.isdigit()), -1)
    return ".".join(parts[index + 1 :]) if index != -1 else module_name


def spectrum_module_scores(model) -> dict[str, float]:
    """Spectrum's score of every module that holds a ``weight`` parameter (tied weights once)."""
    out, seen = {}, set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or id(weight) in seen:
            continue
        seen.add(id(weight))
        out[name] = spectrum_snr(weight)
    return out


def spectrum_selection(scores: dict[str, float], top_percent: float = 50) -> set[str]:
    """Spectrum's unfrozen modules: top ``top_percent`` % per type by score, plus lm_head and embeddings."""
    by_type: dict[str, list[tuple[str, float]]] = {}
    for name, snr in scores.items():
        by_type.setdefault(spectrum_type(name), []).append((name, snr))
    chosen = {name for name in scores if name in SPECTRUM_ALWAYS}
    for layers in by_type.values():
        ranked = sorted(layers, key=lambda x: x[1], reverse=True)
        chosen.update(name for name, _ in ranked[: int(len(layers) * top_percent / 100)])
    return chosen


def kappa_module_scores(model) -> tuple[dict[str, float] | None, set[str] | None, str]:
    """(score per module: higher = KappaTune picks it earlier; its default target set; how) or (None, None, why).

    The score is the module's position in KappaTune's own order (lowest condition number first):
    ``len - position``; modules it does not analyse (not ``nn.Linear``, or a dimension above 16384)
    get no score.
    """
    try:
        import peft
        from peft import find_kappa_target_modules
        from peft.helpers import KappaTuneSelector
    except ImportError as err:
        return None, None, f"the installed peft has no find_kappa_target_modules ({err}); needs a release with KappaTune"
    order = KappaTuneSelector(model, show_progress=False).get_best_targets(top_p=1.0)  # every candidate, lowest kappa first
    targets = find_kappa_target_modules(model, top_p=KAPPA_TOP_P, show_progress=False)["target_modules"]
    scores = {name: float(len(order) - i) for i, name in enumerate(order)}
    how = (f"peft {peft.__version__} KappaTuneSelector.get_best_targets(top_p=1.0) order and "
           f"find_kappa_target_modules(top_p={KAPPA_TOP_P}) targets")
    return scores, set(targets), how


def per_parameter(names: list[str], module_scores: dict[str, float], missing: float) -> list[float]:
    """Each parameter's module score (``missing`` for modules the rule does not score)."""
    return [module_scores.get(module_of(n), missing) for n in names]


def random_scores(size: int, seed: int) -> torch.Tensor:
    """(size,) uniform scores: the ranking of a random mask."""
    return torch.rand(size, generator=torch.Generator().manual_seed(seed))
