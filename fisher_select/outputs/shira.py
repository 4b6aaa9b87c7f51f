"""SHiRA from a run: PEFT's sparse high-rank adapter with each target's top ``r * (m + n)`` coordinates by F.

PEFT's SHiRA trains a fixed sparse set of ``r * (m + n)`` coordinates in every targeted layer
(its own default picks them at random, ``mask_type="random"``). ``shira_config`` picks them by
the run's Fisher instead: within each layer the top coordinates by F (the bound's order for any
objective), ties to the lower flat index. Targets are chosen as LoRA's (``outputs.targets``).

The mask function (``config.mask_fn``, a ``FisherShiraMask``) records the run id and model
fingerprint and refuses layers of any model other than the one it was built for.
"""

from __future__ import annotations

import os
import warnings
import weakref

import peft
import torch

from fisher_select.caveats import MASK_CAVEAT as CAVEAT
from fisher_select.errors import FisherSelectError
from fisher_select.outputs import targets as tg
from fisher_select.outputs.config import DEFAULT_COVERAGE, DEFAULT_RANKING
from fisher_select.run.load import Run, load_run
from fisher_select.stats.ranking import top_k_mask


class FisherShiraMask:
    """SHiRA ``mask_fn``: each targeted layer's top ``r * (m + n)`` coordinates by bound (i.e. by F).

    PEFT 0.21 calls ``mask_fn(base_layer, r, **kwargs)`` with the layer module, not its name.
    The masks are computed by full name up front; the module -> name map is keyed by the
    identity of the model's own ``nn.Linear`` objects (PEFT hands over that very object as
    ``base_layer``), held through weak references so the config never keeps the model alive.
    A layer of any other model object (a reloaded or deep-copied model included) is refused.
    """

    def __init__(self, masks: dict[str, torch.Tensor], names: dict, r: int, provenance: dict):
        self.masks = masks  # full name -> bool (out, in), exactly r * (out + in) True
        self.r = r
        self.provenance = provenance  # run id, model fingerprint, caveat
        self._names = weakref.WeakKeyDictionary(names)  # nn.Module -> full name

    def __call__(self, base_layer, r: int, **kwargs) -> torch.Tensor:
        name = self._names.get(base_layer)
        if name is None:
            raise FisherSelectError(
                "SHiRA asked for the mask of a layer that is not a target of the model given to "
                "shira_config (another model object?); build the config with shira_config(run, this_model)"
            )
        if r != self.r:
            raise FisherSelectError(
                f"ShiraConfig.r is {r} but its Fisher masks were built for r={self.r}; "
                f"rebuild it with shira_config(run, model, r={r})"
            )
        weight = base_layer.weight
        return self.masks[name].to(device=weight.device, dtype=weight.dtype)

    def __deepcopy__(self, memo):
        # Immutable reference data; a deep copy would copy the modules and break the identity map.
        return self


def shira_config(
    run: "Run | str | os.PathLike",
    model,
    *,
    r: int = 32,
    coverage: float | None = None,
    top_n: int | None = None,
    layers_to_transform: list[int] | None = None,
    modules: list[str] | None = None,
    task_type: str | None = "CAUSAL_LM",
    ranking: str = DEFAULT_RANKING,
) -> "peft.ShiraConfig":
    """``peft.ShiraConfig`` whose masks keep each target's top ``r * (m + n)`` coordinates.

    Targets (``nn.Linear`` only, as SHiRA supports) are chosen as in ``lora_hints`` (by ``ranking``
    mass: bound mass by default). ``model``
    must be the model the run was computed on (fingerprint-checked) and the very object later
    passed to ``peft.get_peft_model``. Coordinates rank by F (the bound's order for any objective);
    ties go to the lower flat index. The mask function
    (``config.mask_fn``, a ``FisherShiraMask``) records the run id and fingerprint.
    """
    run = load_run(run)
    layers = sorted({int(i) for i in layers_to_transform}) if layers_to_transform is not None else None
    found = tg.eligible(run, module_types=("Linear",), model=model, layers=layers, modules=modules)
    if coverage is None and top_n is None:
        coverage = DEFAULT_COVERAGE
    targets, _ = tg.choose(found, coverage, top_n, ranking)
    tg.check_unambiguous(targets, run, model)
    masks = {t.name: _shira_mask(t, run.fisher[f"{t.name}.weight"], r) for t in targets}
    names = {model.get_submodule(t.name): t.name for t in targets}
    with warnings.catch_warnings():
        # PEFT warns that it has no built-in mask for any mask_type but "random"; we supply one.
        warnings.filterwarnings("ignore", message=r".*mask_type.*not recognized")
        config = peft.ShiraConfig(r=r, mask_type="fisher", target_modules=[t.name for t in targets],
                                  task_type=task_type)
    config.mask_fn = FisherShiraMask(masks, names, r, run.provenance(CAVEAT))
    return config


def _shira_mask(target: tg.Target, fisher: torch.Tensor, r: int) -> torch.Tensor:
    out_features, in_features = target.shape
    count = r * (out_features + in_features)
    if int(r) != r or r < 1 or count > out_features * in_features:
        raise FisherSelectError(
            f"SHiRA r={r} needs {count} coordinates of {target.name} {target.shape}, "
            "more than it has; lower r"
        )
    return top_k_mask(fisher, count)  # (out, in) bool
