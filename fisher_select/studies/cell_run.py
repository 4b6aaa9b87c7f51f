"""One replicate's cells of the outcome study (protocol v2): train one arm at one lr from theta_0, then measure.

A ``ReplicateCells`` holds what every cell of a replicate shares: the model at theta_0, the task on
the replicate's training prompts (with a frozen teacher for distillation), the run's F, |g_hat| and
signal scale. ``compute(arm, budget, lr, stage)`` trains and returns the cell's result: on the
pilot stage the validation outcome only; on the held-out stage the per-prompt held-out outcomes
(each prompt with its own fixed sampling seed, the same for every arm: common random numbers), the
answer-token NLL and greedy correctness per prompt, the general-text NLL (forgetting) and the
mask's sums. Arm ``start`` is the untrained model, measured the same way.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

from fisher_select.calibration.objectives.base import Context
from fisher_select.errors import FisherSelectError
from fisher_select.studies import measures
from fisher_select.studies.arms import MASK_ARMS, arm_masks, lora_config_model, lora_rank1, mask_sums
from fisher_select.studies.protocol import ProtocolV2
from fisher_select.studies.loop import OnPolicyTask, Streams, TrainConfig, backward, make_task, train
from fisher_select.studies.movement import gradients, load_snapshot, snapshot

EVAL_SEED = 3_000_017  # each evaluated sample's own seed is loop.row_seed(EVAL_SEED, prompt, sample), for every arm
EVAL_ROWS = 32  # sampled rows per evaluation pass (a sample's response does not depend on its pass)
NOISE_SEED = 4_000_037  # the second evaluation of the untrained model: the evaluation's noise floor
START = "start"  # the untrained model as a cell


@dataclass
class Replicate:
    """A replicate's run (its own calibration), model and data: what ``ReplicateCells`` needs."""

    index: int
    run: object  # run.load.Run
    model: object
    tokenizer: object
    objective: object  # the run's primary objective (built from its recipe)
    splits: dict  # "training" / "validation" / "held-out" -> [PromptRecord]
    device: str = "cpu"
    grad_estimate: dict | None = None  # None: the run's gradient-estimate file, if it has one
    general_text: str | None = None  # forgetting is measured on it (None: the prose shipped with the package)
    general_prompts: list[str] | None = None  # and as the KL on responses to these (None: the shipped file)


class ReplicateCells:
    """Computes the cells of one replicate (see the module docstring)."""

    def __init__(self, protocol: ProtocolV2, rep: Replicate, progress: bool = False):
        self.protocol, self.rep, self.progress = protocol, rep, progress
        self.frozen = measures.freeze_teacher(rep.objective, rep.model, rep.tokenizer)  # before any training
        self.theta0 = snapshot(rep.model)
        self.fisher = rep.run.fisher_for(None)
        self.scale = rep.run.signal_scale_of(None)
        self.grad_estimate = rep.grad_estimate
        if self.grad_estimate is None:
            try:
                self.grad_estimate = rep.run.grad_estimate_of(None)
            except FisherSelectError:  # a run without the estimate: the grad_estimate arm says so when asked
                pass
        self.task = self._task_on(rep.model)
        self.first_batch = None
        # the starting model's own responses to general prompts, sampled once: every arm's KL is on these
        self.general_rows, self.general_start = measures.general_responses(
            rep.model, rep.tokenizer, protocol.seed + rep.index, rep.general_prompts)

    def _task_on(self, model):
        objective = copy.copy(self.rep.objective)  # prepare() binds a 'self' teacher to this model only
        ctx = Context(model, self.rep.tokenizer, self.rep.device)
        p = self.protocol
        return make_task(objective, ctx, self.rep.splits["training"], p.samples_per_prompt, p.max_new_tokens)

    def settings(self, lr: float) -> TrainConfig:
        p = self.protocol
        return TrainConfig(p.steps, p.optimizer, lr, p.weight_decay, p.seed + self.rep.index, p.prompts_per_step,
                           p.samples_per_prompt, p.max_new_tokens, p.batch_size)

    def compute(self, arm: str, budget: float | None, lr: float, stage: str) -> dict:
        """Train ``arm`` at ``lr`` from theta_0 (arm ``start``: no training) and measure ``stage``."""
        load_snapshot(self.rep.model, self.theta0)
        model, task, masks, log, sums = self.rep.model, self.task, None, [], None
        started = time.time()
        if arm in MASK_ARMS:
            masks = arm_masks(arm, budget, fisher=self.fisher, grad_estimate=self.grad_estimate,
                              first_batch=self._first_batch() if arm == "first_batch_grad" else None,
                              seed=self.protocol.seed + self.rep.index, theta0=self.theta0)
            sums = mask_sums(masks, self.fisher, self.grad_estimate, self.scale)
        elif arm in ("lora_all_linear_r1", "lora_config"):
            copied = copy.deepcopy(self.rep.model)
            model = lora_rank1(copied) if arm == "lora_all_linear_r1" else lora_config_model(copied, self.rep.run, budget)
            task = self._task_on(model)
        if arm != START:
            task.restart()  # the replicate's seed: every arm sees the same batches
            log = train(model, task, self.settings(lr), masks=masks, sparse=masks is not None,
                        progress=self.progress, desc=f"r{self.rep.index} {arm} {budget} lr {lr:.3g}")
        seconds = time.time() - started
        out = {"arm": arm, "budget": budget, "lr": lr, "training_seconds": seconds, "mask_sums": sums,
               "trainable": _trainable(model, masks, self.theta0, arm), "higher_is_better": task.higher_is_better}
        out |= self._validation(task) if stage == "pilot" else self._held_out(model, task, arm)
        out["log"] = [{k: e[k] for k in ("loss", "outcome", "rows", "rows_with_signal", "finished")} for e in log]
        load_snapshot(self.rep.model, self.theta0)
        return out

    def _validation(self, task) -> dict:
        # SFT: the mean NLL over the validation demonstrations; on-policy: the mean over prompts of each
        # prompt's K samples, each sample on its own seed (common random numbers across lrs and arms)
        if isinstance(task, OnPolicyTask):
            return {"validation": statistics.fmean(task.evaluate_each(self.rep.splits["validation"], EVAL_SEED,
                                                                      EVAL_ROWS))}
        return {"validation": task.evaluate(self.rep.splits["validation"], EVAL_SEED, self.protocol.batch_size)}

    def _held_out(self, model, task, arm: str) -> dict:
        held = self.rep.splits["held-out"]
        bs = self.protocol.batch_size
        out = {"held_out": task.evaluate_each(held, EVAL_SEED, EVAL_ROWS if isinstance(task, OnPolicyTask) else bs),
               "general_text_nll": measures.general_text_nll(model, self.rep.tokenizer, self.rep.general_text),
               "general_kl": measures.general_kl(model, self.general_rows, self.general_start, self.task.pad)}
        if all("answer" in r.fields for r in held):
            out["answer_nll"] = measures.answer_nll(model, self.rep.tokenizer, held)
            out["greedy_correct"] = measures.greedy_correct(model, self.rep.tokenizer, held,
                                                            self.protocol.max_new_tokens)
        if arm == START and isinstance(task, OnPolicyTask):  # the same model, other sampling seeds
            out["held_out_again"] = task.evaluate_each(held, NOISE_SEED, EVAL_ROWS)
        return out

    def _first_batch(self) -> dict:
        """|gradient| of the first batch the replicate's runs start with (SIFT's rule), computed once."""
        if self.first_batch is None:
            self.task.restart()
            batch = self.task.batch(self.protocol.prompts_per_step,
                                    Streams.from_seed(self.protocol.seed + self.rep.index, self.rep.device))
            backward(self.rep.model, batch, self.task.pad, self.protocol.batch_size)
            self.first_batch = {n: g.abs() for n, g in gradients(self.rep.model).items()}
            self.rep.model.zero_grad(set_to_none=True)
        return self.first_batch


def _trainable(model, masks, theta0, arm: str) -> int:
    if masks is not None:
        return sum(int(m.sum()) for m in masks.values())
    if arm == START:
        return 0
    if arm == "full":
        return sum(t.numel() for t in theta0.values())
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

