"""The reference training loop of `fisher-select validate`: plain, seeded, readable.

A step draws one batch from a task, backpropagates the task's loss into ``.grad`` in micro-batches
and takes one optimizer step (``torch.optim.SGD`` or ``AdamW``). A task is the run's objective
turned into a loss whose gradient is the negative of what calibration estimates:

- on-policy objectives (RL, PG distillation, SFT toward a density): fresh samples from the
  *current* policy each step, signal ``a_n`` from the objective itself (RL: leave-one-out
  centred reward), loss ``-(1/B) sum_n a_n l_n`` (``l_n`` the summed response log-probability),
  so the step's gradient is ``-mean_n a_n h_n``, calibration's estimator of ``-g``;
- full-vocabulary distillation (token level): loss ``+(1/B) sum_n sum_t A_t log pi(y_t|s_t)``
  (the gradient of the summed KL, descent);
- SFT from demonstrations: loss ``-(1/B) sum_rows l(row)``, the likelihood of a minibatch of
  demonstrations, summed over each row's tokens (not averaged: docs/TRAPS.md, "Averaged losses").

Weights stay in fp32 (master weights) and the model stays in eval mode, as in calibration (no
dropout), so realized movement is comparable with the calibration-point bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from fisher_select.calibration.objectives.base import Context, Group, Objective, ScoringRow
from fisher_select.calibration.objectives.sft import SFTDemonstrationsObjective, demonstration_rows
from fisher_select.calibration.prompts import PromptRecord, render_prompt
from fisher_select.calibration.sampling import eos_ids_of, pad_id_of, pad_rows, sample_responses
from fisher_select.engine.logprob import response_logprobs
from fisher_select.errors import FisherSelectError
from fisher_select.studies.prefix import prefix_backward, row_logprobs
from fisher_select.training.enforce import apply_masks

OPTIMIZERS = ("sgd", "adamw")


@dataclass
class TrainConfig:
    """One training run: optimizer, steps, batch shape and seed."""

    steps: int
    optimizer: str = "sgd"
    lr: float = 1e-4
    weight_decay: float = 0.0
    seed: int = 0
    prompts_per_step: int = 8  # on-policy: prompts per step; SFT: demonstrations = this x samples_per_prompt
    samples_per_prompt: int = 4  # K, on-policy objectives (>= 2 for leave-one-out)
    max_new_tokens: int = 32
    batch_size: int = 8  # rows per forward/backward (gradient accumulation over micro-batches)

    def problems(self) -> list[str]:
        out = []
        if self.optimizer not in OPTIMIZERS:
            out.append(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            out.append(f"lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            out.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        return out


@dataclass
class Streams:
    """Random streams of one run: prompt/minibatch order (CPU) and sampling (the model's device)."""

    order: torch.Generator
    sampling: torch.Generator

    @classmethod
    def from_seed(cls, seed: int, device) -> "Streams":
        return cls(torch.Generator().manual_seed(seed), torch.Generator(device=device).manual_seed(seed))


@dataclass
class Batch:
    """Rows to backpropagate: prompt + response ids, per-row token weights, and what they scored."""

    rows: list[ScoringRow]
    weights: list[torch.Tensor] | None  # per row (L_row,) weights of the response tokens; None: all 1
    sign: float  # loss = sign * sum_rows sum_t w_t log pi(y_t|s_t) / len(rows)
    outcome: float | None  # the step's objective value (mean reward, ...) on these rows; None: the loss is it
    groups: list[list[int]] = field(default_factory=list)  # row indices per prompt group (split points)
    finished: int | None = None  # sampled responses that ended before max_new_tokens (None: not sampled)
    group_outcomes: list[float] = field(default_factory=list)  # the objective's mean value per prompt group

    def rows_with_signal(self) -> int:
        """Rows whose loss weights are not all 0 (RL: a prompt whose K rewards are equal trains nothing)."""
        if self.weights is None:
            return len(self.rows)
        return sum(int(bool((w != 0).any())) for w in self.weights)

    def part(self, group_ids: list[int]) -> "Batch":
        """The sub-batch of some prompt groups (a batch half keeps its groups whole)."""
        idx = [i for g in group_ids for i in self.groups[g]]
        weights = None if self.weights is None else [self.weights[i] for i in idx]
        groups, start = [], 0
        for g in group_ids:
            groups.append(list(range(start, start + len(self.groups[g]))))
            start += len(self.groups[g])
        return Batch([self.rows[i] for i in idx], weights, self.sign, self.outcome, groups)


def row_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of sample ``sample`` of prompt ``prompt`` in an evaluation seeded ``seed`` (distinct for
    up to 1,000 samples per prompt)."""
    return seed * 1_000_003 + 1_000 * prompt + sample


def _finite_mean(values) -> float:
    finite = [v for v in values if v is not None and abs(v) != float("inf")]
    return sum(finite) / len(finite) if finite else float("nan")


class _Order:
    """Indices 0..n-1 in seeded random order, reshuffled after each pass (epochs of prompts)."""

    def __init__(self, n: int):
        self.n, self.queue = n, []

    def take(self, count: int, gen: torch.Generator) -> list[int]:
        out = []
        while len(out) < count:
            if not self.queue:
                self.queue = torch.randperm(self.n, generator=gen).tolist()
            out.append(self.queue.pop(0))
        return out


class OnPolicyTask:
    """The run's objective trained on fresh samples of the current policy (RL and friends)."""

    def __init__(self, objective: Objective, ctx: Context, records: list[PromptRecord], k: int,
                 max_new_tokens: int):
        if isinstance(objective, SFTDemonstrationsObjective):
            raise FisherSelectError("SFT from demonstrations has no on-policy signal; it trains with DemonstrationTask")
        if k < objective.min_samples_per_prompt:
            raise FisherSelectError(f"objective {objective.name!r} needs samples_per_prompt >= "
                                    f"{objective.min_samples_per_prompt} (got {k})")
        self.objective, self.ctx, self.records, self.k, self.max_new = objective, ctx, records, k, max_new_tokens
        self.rendered = [render_prompt(ctx.tokenizer, r) for r in records]
        self.eos = eos_ids_of(ctx.model, ctx.tokenizer)
        self.pad = pad_id_of(ctx.model, ctx.tokenizer)
        self.order = _Order(len(records))
        self.description = (f"on-policy {objective.kind}: fresh samples of the current policy, K = {k} per prompt, "
                            + ("loss +mean_n sum_t A_t log pi(y_t|s_t) (token level)" if objective.token_level
                               else "loss -mean_n a_n l_n with the objective's own signal a_n"))
        self.outcome_name = "mean per-sample value of the objective (reward for RL)"
        # RL reward and PG distillation's sigma = -KL per sample go up; full-vocabulary distillation reports KL
        self.higher_is_better = not objective.token_level
        self.population = None  # fresh samples every step: an infinite population

    def restart(self) -> None:
        """Forget the prompt order, so that a run with a given seed sees the same prompts as any other."""
        self.order = _Order(len(self.records))

    def step_rows(self, prompts: int) -> int:
        return prompts * self.k

    def batch(self, prompts: int, streams: Streams) -> Batch:
        picked = self.order.take(prompts, streams.order)
        return self._sampled_batch([self.records[i] for i in picked], [self.rendered[i] for i in picked],
                                   streams.sampling)

    def _sampled_batch(self, records, rendered, gen) -> Batch:
        groups = self._sample(records, rendered, gen)
        rows, weights, values, index, per_group = [], [], [], [], []
        for g in groups:
            sig = self.objective.signals(g, self.ctx)  # the objective's own signal (leave-one-out for RL)
            per_group.append(_finite_mean(sig.values))
            index.append(list(range(len(rows), len(rows) + len(g.responses))))
            for k, resp in enumerate(g.responses):
                rows.append(ScoringRow(g.prompt_ids + resp, len(g.prompt_ids)))
                if self.objective.token_level:
                    weights.append(sig.token_signal[k].float())  # (L_k,) A_t
                else:
                    weights.append(torch.full((len(resp),), float(sig.signal[k])))  # (L_k,) a_n on every token
            values.extend(sig.values)
        sign = 1.0 if self.objective.token_level else -1.0  # token level: KL descent; else ascent of E[a l]
        return Batch(rows, weights, sign, _finite_mean(values), index, sum(sum(g.ended) for g in groups), per_group)

    def evaluate_each(self, records: list[PromptRecord], seed: int, rows_per_pass: int) -> list[float]:
        """Per prompt, the mean objective value of its K samples. Sample k of prompt i draws from its own
        generator (``row_seed``), so its response depends on the model and the prompt alone, not on the
        other prompts of its pass: every arm is evaluated on common random numbers."""
        rendered = [render_prompt(self.ctx.tokenizer, r) for r in records]
        per, out = max(1, rows_per_pass // self.k), []
        for i in range(0, len(records), per):
            gens = [torch.Generator(device=self.ctx.device).manual_seed(row_seed(seed, j, k))
                    for j in range(i, min(i + per, len(records))) for k in range(self.k)]
            out += self._sampled_batch(records[i : i + per], rendered[i : i + per], gens).group_outcomes
        return out

    def _sample(self, records, rendered, gen) -> list[Group]:
        rows = [ids for ids in rendered for _ in range(self.k)]
        drawn = sample_responses(self.ctx.model, rows, eos_ids=self.eos, pad_id=self.pad,
                                 max_new_tokens=self.max_new, generator=gen)
        out = []
        for j, (record, ids) in enumerate(zip(records, rendered)):
            part = drawn[j * self.k : (j + 1) * self.k]
            texts = [self.ctx.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in part]
            out.append(Group(record, ids, [s.response_ids for s in part], texts, [s.logprob for s in part],
                             [s.ended for s in part]))
        return out

    def evaluate(self, records: list[PromptRecord], seed: int, rows_per_pass: int) -> float:
        """Mean objective value on ``records`` (K samples each), with a fixed sampling seed."""
        gen = torch.Generator(device=self.ctx.device).manual_seed(seed)
        rendered = [render_prompt(self.ctx.tokenizer, r) for r in records]
        per = max(1, rows_per_pass // self.k)
        outcomes, counts = [], []
        for i in range(0, len(records), per):
            b = self._sampled_batch(records[i : i + per], rendered[i : i + per], gen)
            outcomes.append(b.outcome * len(b.rows))
            counts.append(len(b.rows))
        return sum(outcomes) / sum(counts)


class DemonstrationTask:
    """SFT from demonstrations: the summed log-likelihood of a minibatch of demonstration rows."""

    def __init__(self, objective: SFTDemonstrationsObjective, ctx: Context, records: list[PromptRecord], k: int):
        objective.prepare(ctx, records)  # pairs the demonstrations with the training prompts
        self.rows = demonstration_rows(ctx.tokenizer, objective.pairs, objective.append_eos)
        self.objective, self.ctx, self.k = objective, ctx, k
        self.pad = pad_id_of(ctx.model, ctx.tokenizer)
        self.order = _Order(len(self.rows))
        self.description = ("SFT from demonstrations: loss -mean over a minibatch of demonstration rows of the "
                            "summed log-likelihood (prompts_per_step x samples_per_prompt rows, at most all of them)")
        self.outcome_name = "mean negative log-likelihood per demonstration (summed over its tokens)"
        self.higher_is_better = False
        self.population = len(self.rows)  # minibatches are drawn without replacement from these rows

    def restart(self) -> None:
        """Forget the minibatch order, so that a run with a given seed sees the same rows as any other."""
        self.order = _Order(len(self.rows))

    def step_rows(self, prompts: int) -> int:
        return min(len(self.rows), prompts * self.k)

    def batch(self, prompts: int, streams: Streams) -> Batch:
        count = self.step_rows(prompts)
        picked = self.order.take(count, streams.order)
        rows = [self.rows[i] for i in picked]
        # outcome None: train() logs the loss, which here is the mean NLL per row at the same parameters,
        # so no second forward pass is spent on the log
        return Batch(rows, None, -1.0, None, [[i] for i in range(len(rows))])  # rows are independent

    def evaluate_each(self, records: list[PromptRecord], seed: int, rows_per_pass: int) -> list[float]:
        """Per prompt, the mean NLL per demonstration of its demonstrations (forward only: ``seed`` unused),
        every prompt's rows scored in one call (their shared prefix once)."""
        pairs, logps = self._scored(records, rows_per_pass)
        nll: dict[int, list[float]] = {}
        for (record, _), lp in zip(pairs, logps):
            nll.setdefault(record.index, []).append(-lp)
        return [sum(nll[r.index]) / len(nll[r.index]) for r in records]

    def evaluate(self, records: list[PromptRecord], seed: int, rows_per_pass: int) -> float:
        """Mean NLL per demonstration of the demonstrations paired with ``records``."""
        _, logps = self._scored(records, rows_per_pass)
        return -sum(logps) / len(logps)

    @torch.no_grad()
    def _scored(self, records: list[PromptRecord], micro: int) -> tuple[list, list[float]]:
        """The demonstration pairs of ``records`` and each one's summed log-likelihood."""
        other = SFTDemonstrationsObjective(self.objective.path, self.objective.append_eos)
        other.prepare(self.ctx, records)
        rows = demonstration_rows(self.ctx.tokenizer, other.pairs, other.append_eos)
        return other.pairs, row_logprobs(self.ctx.model, rows, self.pad, self.ctx.device, micro)


def make_task(objective: Objective, ctx: Context, records: list[PromptRecord], k: int, max_new_tokens: int):
    """The training task of an objective (its ``prepare`` runs here: teachers, demonstrations)."""
    if isinstance(objective, SFTDemonstrationsObjective):
        return DemonstrationTask(objective, ctx, records, k)
    objective.prepare(ctx, records)
    return OnPolicyTask(objective, ctx, records, k, max_new_tokens)


def token_weights(rows: list[ScoringRow], weights: list[torch.Tensor], width: int, device) -> torch.Tensor:
    """(B, T) weights at each row's response tokens (rows left padded to ``width``)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, (r, w) in enumerate(zip(rows, weights)):
        out[b, width - len(r.ids) + r.start :] = w
    return out.to(device)


def backward(model, batch: Batch, pad: int, micro: int) -> float:
    """Accumulate the gradient of the batch's loss into ``.grad``, ``micro`` rows per backward."""
    device = next(model.parameters()).device
    total, n = 0.0, len(batch.rows)
    shared = prefix_backward(model, batch.rows, batch.weights, batch.sign, n, pad, micro)  # the prefix run once
    if shared is not None:
        return shared
    for i in range(0, n, micro):
        rows = batch.rows[i : i + micro]
        ids, mask, resp = pad_rows(rows, pad, device)  # (B, T) each
        tw = None if batch.weights is None else token_weights(rows, batch.weights[i : i + micro], ids.shape[1],
                                                               device)
        logp = response_logprobs(model, ids, mask, resp, tw)  # (B,) fp32, summed over tokens
        loss = batch.sign * logp.sum() / n
        loss.backward()
        total += float(loss.detach())
    return total


def make_optimizer(params, settings: TrainConfig) -> torch.optim.Optimizer:
    if settings.optimizer == "sgd":
        return torch.optim.SGD(params, lr=settings.lr, weight_decay=settings.weight_decay)
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)


def train(model, task, settings: TrainConfig, *, masks: dict | None = None, sparse: bool = False,
          progress: bool = True, desc: str = "training", after_step=None) -> list[dict]:
    """Train ``model`` in place for ``settings.steps`` steps; one log entry per step.

    ``masks`` (name -> bool, True = may move): masked full fine-tuning through ``apply_masks``
    (masked coordinates stay bit-identical, AdamW's decay and momentum included); with ``sparse``,
    through the sparse-delta mode (the same steps, state for the selected coordinates only; the
    delta is merged into the weights at the end, so movement is measured on the weights as usual).
    ``after_step(step)``, if given, runs after each optimizer step (e.g. to record movement).
    """
    problems = settings.problems()
    if problems:
        raise FisherSelectError("invalid training settings: " + "; ".join(problems))
    handle = apply_masks(model, masks, sparse=sparse) if masks is not None else None
    try:
        params = handle.parameters() if sparse and handle is not None else [
            p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(params, settings)
        streams = Streams.from_seed(settings.seed, next(model.parameters()).device)
        log = []
        for step in tqdm(range(settings.steps), desc=desc, unit="step", disable=not progress):
            batch = task.batch(settings.prompts_per_step, streams)
            optimizer.zero_grad(set_to_none=True)
            loss = backward(model, batch, task.pad, settings.batch_size)
            optimizer.step()
            if after_step is not None:
                after_step(step)
            outcome = loss if batch.outcome is None else batch.outcome  # None: the loss is the outcome (SFT)
            log.append({"step": step, "loss": loss, "outcome": outcome, "rows": len(batch.rows),
                        "rows_with_signal": batch.rows_with_signal(), "finished": batch.finished})
        optimizer.zero_grad(set_to_none=True)
        return log
    finally:
        if handle is not None:
            handle.remove()
