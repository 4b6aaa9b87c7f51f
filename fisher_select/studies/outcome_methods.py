"""The methods the outcome study of protocol 1 compares (``studies.outcomes``): how each builds its trainable set.

Deprecated with the study (protocol 2's arms are ``studies.arms``). Masks at each density (the bound,
``|g_hat|``, single-batch ``|grad|``, random, ``|theta|``), module choices (Spectrum, KappaTune) and
adapters at lora_config's trainable count (LoRA, SHiRA), each timed as it is built.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import peft
import torch

from fisher_select.errors import FisherSelectError
from fisher_select.outputs.lora import lora_hints, trainable_lora_parameters
from fisher_select.outputs.shira import shira_config
from fisher_select.stats.naming import module_of
from fisher_select.stats.ranking import global_top_masks
from fisher_select.studies import baselines
from fisher_select.studies.loop import Streams, backward
from fisher_select.studies.movement import gradients, load_snapshot
from fisher_select.studies.validate import MASK_STREAM

MASK_METHODS = ("bound", "grad_estimate", "single_batch_grad", "random", "magnitude")  # at each density
MODULE_METHODS = ("spectrum", "kappatune")  # at their own share
ADAPTER_METHODS = ("lora_config", "lora_all_linear", "lora_attention", "shira_fisher", "shira_random")
METHODS = MASK_METHODS + MODULE_METHODS + ADAPTER_METHODS
ATTENTION_WORDS = ("attn", "attention")  # a module path segment holding one of these is attention


@dataclass
class Method:
    """One method to train: how to make its trainable set for a seed (masks, or a PEFT model)."""

    name: str
    kind: str  # mask / modules / lora / shira
    density: float | None = None
    masks: object = None  # seed -> {name: bool tensor}
    adapter: object = None  # (seed, base model copy) -> PEFT model
    trainable: int = 0
    selection_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    unavailable: str | None = None

    def __post_init__(self):
        self.requested = self.density  # the density asked for (masks: the realized one replaces density)


def uniform_rank(budget: int, per_rank: int) -> int:
    """The largest uniform rank whose count ``r * per_rank`` does not exceed ``budget`` (at least 1)."""
    return max(1, budget // per_rank)


def attention_modules(model) -> list[str]:
    """Full names of the Linear modules inside attention blocks (a path segment names attention)."""
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and any(w in part for part in name.split(".") for w in ATTENTION_WORDS)]



class Selections:
    """Builds the study's methods from its run, model at theta_0, task and seeds (``study``: a ``_Study``)."""

    def __init__(self, study, grad_estimate: dict | None):
        self.run, self.setup, self.config, self.seeds = study.run, study.setup, study.config, study.seeds
        self.task, self.base, self.theta0, self.total = study.task, study.base, study.theta0, study.total
        self.grad_estimate = grad_estimate  # the run's |g_hat| source; None: read from the run when needed
        self.budget: int | str | None = None  # lora_config's trainable count (or why there is none)

    def methods(self) -> list[Method]:
        """Every method the config asks for, masks once per density."""
        wanted = set(self.config.methods)
        out = []
        for name in MASK_METHODS:
            if name in wanted:
                out += [self._timed(getattr(self, f"_mask_{name}"), d) for d in self.config.densities]
        for name in MODULE_METHODS + ADAPTER_METHODS:
            if name in wanted:
                out.append(self._timed(getattr(self, f"_{name}")))
        return out

    def _timed(self, build, *args) -> Method:
        started = time.time()
        method = build(*args)
        method.selection_seconds = time.time() - started
        if method.masks is not None and method.unavailable is None:  # the count of the first seed's mask
            method.trainable = sum(int(m.sum()) for m in method.masks(self.seeds[0]).values())
            method.density = method.trainable / self.total
        return method

    def _top(self, name: str, density: float, scores: dict) -> Method:
        masks = global_top_masks(scores, density)
        return Method(name, "mask", density, masks=lambda seed: masks)

    def _mask_bound(self, density: float) -> Method:
        return self._top("bound", density, self.run.fisher_for(None))  # sqrt(F S) ranks as F

    def _mask_grad_estimate(self, density: float) -> Method:
        grad, why = self._grad_estimate()
        if grad is None:
            return Method("grad_estimate", "mask", density, unavailable=why)
        return self._top("grad_estimate", density, {n: g.abs() for n, g in grad.items()})

    def _grad_estimate(self):
        if self.grad_estimate is None:
            try:
                self.grad_estimate = self.run.grad_estimate_of(None)
            except FisherSelectError as err:  # recorded as the method's reason, never fatal
                return None, str(err)
        return self.grad_estimate, ""

    def _mask_single_batch_grad(self, density: float) -> Method:
        cache: dict[int, dict] = {}

        def masks(seed: int) -> dict:
            if seed not in cache:
                cache[seed] = global_top_masks(self._first_batch_gradient(seed), density)
            return cache[seed]

        return Method("single_batch_grad", "mask", density, masks=masks,
                      notes=["SIFT's rule: top |gradient| of the first training batch of each seed"])

    def _first_batch_gradient(self, seed: int) -> dict:
        """|gradient| of the very batch a run with ``seed`` starts with (same order, same samples)."""
        load_snapshot(self.setup.model, self.theta0)
        self.task.restart()
        batch = self.task.batch(self.base.prompts_per_step, Streams.from_seed(seed, self.setup.device))
        backward(self.setup.model, batch, self.task.pad, self.base.batch_size)
        out = {n: g.abs() for n, g in gradients(self.setup.model).items()}
        self.setup.model.zero_grad(set_to_none=True)
        return out

    def _mask_random(self, density: float) -> Method:
        def masks(seed: int) -> dict:
            gen = torch.Generator().manual_seed(seed + MASK_STREAM)  # a fresh random mask per seed
            return global_top_masks({n: torch.rand(t.shape, generator=gen) for n, t in self.theta0.items()}, density)

        return Method("random", "mask", density, masks=masks)

    def _mask_magnitude(self, density: float) -> Method:
        return self._top("magnitude", density, {n: t.abs() for n, t in self.theta0.items()})

    def _module_masks(self, name: str, chosen: set[str], note: str) -> Method:
        masks = {n: torch.full(t.shape, module_of(n) in chosen) for n, t in self.theta0.items()}
        return Method(name, "modules", masks=lambda seed: masks, notes=[f"{note}; {len(chosen)} modules"])

    def _spectrum(self) -> Method:
        chosen = baselines.spectrum_selection(baselines.spectrum_module_scores(self.setup.model))
        return self._module_masks("spectrum", chosen, "top 50% per type by weight SNR + lm_head + embed_tokens")

    def _kappatune(self) -> Method:
        _, targets, how = baselines.kappa_module_scores(self.setup.model)
        if targets is None:
            return Method("kappatune", "modules", unavailable=how)
        return self._module_masks("kappatune", targets, how)

    def _hints(self):
        return lora_hints(self.run, mean_rank=self.config.lora_mean_rank, model=self.setup.model)

    def _lora_config(self) -> Method:
        hints = self._hints()
        return self._adapter("lora_config", "lora", lambda seed: hints.peft_config(),
                             [f"fisher_select lora_config: {len(hints.target_modules)} targets, total rank "
                              f"{sum(hints.ranks.values())}"])

    def _uniform_lora(self, name: str, targets) -> Method:
        budget = self._lora_budget()
        if isinstance(budget, str):
            return Method(name, "lora", unavailable=budget)
        per_rank = self._count(peft.LoraConfig(r=1, lora_alpha=2, target_modules=targets, task_type="CAUSAL_LM"))
        r = uniform_rank(budget, per_rank)
        fits = "at most" if r * per_rank <= budget else "MORE than (rank 1 is already above it)"
        note = (f"uniform rank {r}: {r * per_rank} trainable, {fits} lora_config's {budget} (the largest uniform "
                "rank that does not exceed it)")
        return self._adapter(name, "lora", lambda seed: peft.LoraConfig(
            r=r, lora_alpha=2 * r, target_modules=targets, task_type="CAUSAL_LM"), [note])

    def _lora_all_linear(self) -> Method:
        return self._uniform_lora("lora_all_linear", "all-linear")  # PEFT's own: every Linear but the head

    def _lora_attention(self) -> Method:
        names = attention_modules(self.setup.model)
        if not names:
            return Method("lora_attention", "lora", unavailable="no Linear module has 'attn' or 'attention' in its path")
        return self._uniform_lora("lora_attention", names)

    def _lora_budget(self) -> int | str:
        if self.budget is None:  # counted once, on a copy adapted with lora_config
            try:
                self.budget = self._count(self._hints().peft_config())
            except FisherSelectError as err:
                self.budget = f"lora_config failed, so there is no count to match: {err}"
        return self.budget

    def _shira_targets(self, model) -> list[str]:
        return list(shira_config(self.run, model, r=self.config.shira_r).target_modules)

    def _shira_fisher(self) -> Method:
        # SHiRA's mask function is bound to the very model object PEFT adapts: one per copy
        return self._adapter("shira_fisher", "shira", None,
                             [f"SHiRA r={self.config.shira_r}, each target's top r(m+n) coordinates by F"],
                             build=lambda seed, model: peft.get_peft_model(
                                 model, shira_config(self.run, model, r=self.config.shira_r)))

    def _shira_random(self) -> Method:
        targets = self._shira_targets(self.setup.model)
        return self._adapter("shira_random", "shira", lambda seed: peft.ShiraConfig(
            r=self.config.shira_r, mask_type="random", random_seed=seed, target_modules=targets,
            task_type="CAUSAL_LM"), [f"SHiRA's random mask, r={self.config.shira_r}, the Fisher SHiRA's targets"])

    def _adapter(self, name: str, kind: str, make_config, notes: list[str], build=None) -> Method:
        build = build or (lambda seed, model: peft.get_peft_model(model, make_config(seed)))
        probe = build(self.seeds[0], copy.deepcopy(self.setup.model))  # counted on the adapted model
        trainable = trainable_lora_parameters(probe)
        return Method(name, kind, trainable / self.total, adapter=build, trainable=trainable, notes=notes)

    def _count(self, config) -> int:
        return trainable_lora_parameters(peft.get_peft_model(copy.deepcopy(self.setup.model), config))
