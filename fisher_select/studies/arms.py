"""The arms of the outcome study (protocol v2): which coordinates each one trains, and the sums the lr advice tests.

Mask arms at a density (the share of all coordinates): the bound (top sqrt(F S), F's order),
``|g_hat|`` (the calibration's gradient estimate), first-batch ``|grad|`` (SIFT's rule: the first
training batch of the replicate), a random mask, and a random mask with the bound's per-tensor counts
(it separates "which tensors" from "which coordinates within a tensor"). Beside them: all-linear
LoRA at rank 1 (PEFT) and full fine-tuning, the reference, at their own counts.
"""

from __future__ import annotations

import math

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.stats.ranking import global_top_masks, masked_abs_sum

MASK_ARMS = ("bound", "grad_estimate", "first_batch_grad", "random", "random_tensor_counts", "magnitude")
BUDGETED_ARMS = MASK_ARMS + ("lora_config",)  # run at every budget (lora_config: the nearest trainable count)
OWN_COUNT_ARMS = ("lora_all_linear_r1", "full")  # their own trainable count: no density
ARMS = BUDGETED_ARMS + OWN_COUNT_ARMS
LATER_ARMS = ("magnitude", "lora_config")  # issue 32's "then" list: run when the core is done (--arms)
CORE_ARMS = tuple(a for a in ARMS if a not in LATER_ARMS)  # the study's default
MAX_TOTAL_RANK = 1 << 14  # lora_config's total rank is searched up to this
RANDOM_STREAM = 2_000_003  # offset of the random masks' generator from the replicate's seed


def arm_name(arm: str, budget: float | None) -> str:
    """How tables and records name an arm: ``bound@0.0001``, or ``full`` for an arm at its own count."""
    return arm if budget is None else f"{arm}@{budget:g}"


def random_masks(shapes: dict[str, tuple], density: float, seed: int) -> dict[str, torch.Tensor]:
    """A uniformly random mask of the top ``density`` share (exactly the count the other rules take)."""
    gen = torch.Generator().manual_seed(seed + RANDOM_STREAM)
    return global_top_masks({n: torch.rand(s, generator=gen) for n, s in shapes.items()}, density)


def random_with_counts(reference: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Random positions with ``reference``'s count in every tensor."""
    gen = torch.Generator().manual_seed(seed + RANDOM_STREAM + 1)
    out = {}
    for name, ref in reference.items():
        flat = torch.zeros(ref.numel(), dtype=torch.bool)
        flat[torch.randperm(ref.numel(), generator=gen)[: int(ref.sum())]] = True
        out[name] = flat.reshape(ref.shape)
    return out


def arm_masks(arm: str, density: float, *, fisher: dict, grad_estimate: dict | None, first_batch: dict | None,
              seed: int, theta0: dict | None = None) -> dict[str, torch.Tensor]:
    """The masks of one mask arm at ``density`` for the replicate with ``seed`` (``theta0``: the starting
    parameters, for the ``magnitude`` arm)."""
    if arm == "bound":
        return global_top_masks(fisher, density)  # sqrt(F S) ranks as F for one objective
    if arm == "grad_estimate":
        if grad_estimate is None:
            raise FisherSelectError("the grad_estimate arm needs the run's gradient estimate "
                                    "(grad_estimate.safetensors); recalibrate, or leave the arm out")
        return global_top_masks({n: g.abs() for n, g in grad_estimate.items()}, density)
    if arm == "first_batch_grad":
        return global_top_masks({n: g.abs() for n, g in first_batch.items()}, density)
    if arm == "random":
        return random_masks({n: tuple(f.shape) for n, f in fisher.items()}, density, seed)
    if arm == "random_tensor_counts":
        return random_with_counts(global_top_masks(fisher, density), seed)
    if arm == "magnitude":
        return global_top_masks({n: theta0[n].abs() for n in fisher}, density)
    raise FisherSelectError(f"unknown mask arm {arm!r}; known: {', '.join(MASK_ARMS)}")


def mask_sums(masks: dict[str, torch.Tensor], fisher: dict, grad_estimate: dict | None,
              scale: float | None) -> dict:
    """Over the mask: the sum of |g_hat_i| and of sqrt(F_i S) (fp64), the first-order progress the lr
    advice is tested on (None where the run has no gradient estimate or no signal scale)."""
    bound = sum(float(fisher[n][m].double().sqrt().sum()) for n, m in masks.items())  # F >= 0: no abs
    out = {"abs_g_hat": None, "sqrt_fs": None if scale is None else bound * math.sqrt(scale),
           "sqrt_f": bound, "count": sum(int(m.sum()) for m in masks.values())}
    if grad_estimate is not None:
        out["abs_g_hat"] = masked_abs_sum(grad_estimate, masks)
    return out


def lora_rank1(model):
    """``model`` adapted with PEFT all-linear LoRA at rank 1 (alpha 2, as lora_config's convention)."""
    import peft

    config = peft.LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def lora_count(model, hints) -> int:
    """Trainable LoRA parameters of ``hints`` on ``model`` (fused experts: one adapter per expert)."""
    from fisher_select.outputs.lora import lora_trainable

    return lora_trainable({n: tuple(p.shape) for n, p in model.named_parameters()}, hints.ranks)


def lora_config_at(run, model, count: int):
    """fisher_select's ``lora_config`` (rank step 1) at the total rank whose trainable count is nearest
    ``count`` (ties: the smaller), with its count; the smallest when even one rank per target exceeds it.
    Bisection on the total rank: the count grows with it."""
    from fisher_select.outputs.lora import lora_hints

    def at(total: int):
        hints = lora_hints(run, model=model, rank_step=1, total_rank=total)
        return hints, lora_count(model, hints)

    targets = len(lora_hints(run, model=model, rank_step=1, mean_rank=1).ranks)  # total rank >= one per target
    lo, hi = targets, max(targets, MAX_TOTAL_RANK)  # the smallest total whose count reaches ``count`` is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid)[1] >= count:
            hi = mid
        else:
            lo = mid + 1
    above = at(lo)
    below = at(lo - 1) if lo > targets else None
    if below is not None and count - below[1] <= above[1] - count:
        return below
    return above


def lora_config_model(model, run, budget: float):
    """``model`` adapted (PEFT) with ``lora_config`` at the count nearest ``budget`` x its parameters."""
    import peft

    total = sum(p.numel() for p in model.parameters())
    hints, _ = lora_config_at(run, model, round(budget * total))
    return peft.get_peft_model(model, hints.peft_config())
