"""The calibration pass: sample from the model, score every sample exactly, estimate F, S, g, bounds.

For each batch of prompt groups (K responses per prompt, plain ancestral sampling), every
objective turns its group into signals a_n; one scoring pass (``score_sums``) adds the exact
per-sample squared scores (shared Fisher), the signal-weighted scores of every objective and
the plain score sums. At the end everything is divided by the number of samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from fisher_select.calibration.distributed import all_reduce_int, all_reduce_sums, gather_objects, rank_world, seed_for_rank, shard
from fisher_select.engine.scoring import Coverage, ScoreSums, plan_coverage, score_sums
from fisher_select.errors import FisherSelectError
from fisher_select.engine.logprob import response_logprobs
from fisher_select.calibration.objectives import Context, Group, Objective
from fisher_select.calibration.prompts import PromptRecord, render_prompt
from fisher_select.engine.rules.bnb import keep_trainable_layout
from fisher_select.rundir import coordinate_bound
from fisher_select.calibration.sampling import SamplingConfig, left_pad, sample_responses


@dataclass
class ObjectiveResult:
    """One objective's scale, gradient estimate and report fields."""

    name: str
    signal_scale: float | None
    grad_estimate: dict[str, torch.Tensor]
    summary: dict


@dataclass
class Calibration:
    """Result of ``calibrate``: means over all N*K samples (not sums)."""

    fisher: dict[str, torch.Tensor]  # F_i = mean_n h_{n,i}^2
    score_mean: dict[str, torch.Tensor]  # mean_n h_n, ~0 (a check of the sampling)
    objectives: list[ObjectiveResult]
    num_prompts: int
    num_samples: int
    num_truncated: int
    samples: list[dict] = field(default_factory=list)
    coverage: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    token_fisher: dict[str, torch.Tensor] | None = None  # F^tok, when a token-level objective ran

    @property
    def signal_scale(self) -> float | None:
        return self.objectives[0].signal_scale

    @property
    def grad_estimate(self) -> dict[str, torch.Tensor]:
        return self.objectives[0].grad_estimate

    @property
    def truncation_rate(self) -> float:
        return self.num_truncated / max(1, self.num_samples)

    def objective(self, name: str | None) -> ObjectiveResult:
        if name is None:
            return self.objectives[0]
        for o in self.objectives:
            if o.name == name:
                return o
        raise FisherSelectError(f"no objective {name!r}; have {[o.name for o in self.objectives]}")

    def fisher_for(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """The Fisher an objective's bound uses: token-level for token-level objectives."""
        token = self.objective(objective).summary.get("token_level", False)
        return self.token_fisher if token else self.fisher

    def bound(self, objective: str | None = None) -> dict[str, torch.Tensor]:
        """``sqrt(F_i * S)``; ``sqrt(F_i)`` when S is unknown (same ranking, no absolute scale)."""
        return coordinate_bound(self.fisher_for(objective), self.objective(objective).signal_scale)

    def mixed_bound(self, weights: dict[str, float]) -> dict[str, torch.Tensor]:
        """``sum_o |c_o| sqrt(F^(o)_i S_o)`` for a weighted mix of objectives on the same samples.

        For sequence-level objectives F^(o) = F and this is ``sqrt(F_i) sum_o |c_o| sqrt(S_o)``
        (MATH.md); a token-level objective brings its own factor sqrt(F^tok_i S_tok).
        """
        out: dict[str, torch.Tensor] = {}
        for name, c in weights.items():
            if self.objective(name).signal_scale is None:
                raise FisherSelectError(f"objective {name!r} has an unknown signal scale; it cannot enter a mixed bound")
            for n, b in self.bound(name).items():
                out[n] = out[n] + abs(c) * b if n in out else abs(c) * b
        return out


def calibrate(
    model,
    tokenizer,
    prompts: list[PromptRecord],
    objective: Objective | list[Objective],
    *,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 64,
    seed: int = 0,
    batch_size: int = 8,
    sampling: SamplingConfig | None = None,
    progress: bool = True,
    verify: bool = True,
) -> Calibration:
    """Estimate the model Fisher from the model's own samples and each objective's signal scale.

    ``objective`` may be a list: F is computed once, each objective gets its own S and gradient
    estimate. Objectives have two hooks (no-ops by default): ``prepare(ctx, prompts)``, called
    before sampling (load a teacher, check its data against the prompts; raise
    FisherSelectError), and ``finish(cal, ctx) -> dict``, called at the end with the finished
    Calibration; its dict is merged into the objective's summary, and it may replace its
    ``grad_estimate`` (SFT from demonstrations: the demonstrations' mean score). ``verify``
    compares the engine's score sums with plain autograd on the first batch (catches a
    parameter used outside its module, which no hook could see).
    """
    objectives = objective if isinstance(objective, list) else [objective]
    check_inputs(prompts, objectives, samples_per_prompt, sampling or SamplingConfig())
    was_training = model.training
    model.eval()
    try:
        with keep_trainable_layout(model):
            return _Calibrator(model, tokenizer, objectives, samples_per_prompt, max_new_tokens, seed,
                               batch_size, progress, verify).run(prompts)
    finally:
        model.train(was_training)


def check_inputs(prompts, objectives, k, sampling: SamplingConfig) -> None:
    """Every problem with the calibration settings, as one error (before any model work)."""
    problems = sampling.problems()
    if not prompts:
        problems.append("no prompts to calibrate on")
    for o in objectives:
        if o.used:
            problems.append(f"objective {o.name!r} already holds statistics from another calibration; "
                            "pass a new objective instance")
        if k < o.min_samples_per_prompt:
            problems.append(
                f"objective {o.name!r} needs samples_per_prompt >= {o.min_samples_per_prompt} "
                f"(got {k}): its signal is centred by the other samples of the same prompt"
            )
    names = [o.name for o in objectives]
    if len(set(names)) != len(names):
        problems.append(f"objective names must be unique, got {names}")
    if problems:
        raise FisherSelectError("; ".join(problems))


def eos_ids_of(model, tokenizer) -> set[int]:
    """EOS ids from the tokenizer and the model's generation config (which may list several)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if not ids:
        raise FisherSelectError("the tokenizer defines no EOS token: responses would never end; set tokenizer.eos_token")
    return ids


@dataclass
class _Batch:
    """A scoring batch: prompt + response rows, left padded."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    response_mask: torch.Tensor  # (B, T) True at response tokens
    groups: list[Group]


class _Calibrator:
    """State of one calibration pass (accumulators, generator, progress bars)."""

    def __init__(self, model, tokenizer, objectives, k, max_new_tokens, seed, batch_size, progress, verify):
        self.model, self.tokenizer, self.objectives = model, tokenizer, objectives
        self.k, self.max_new_tokens, self.verify = k, max_new_tokens, verify
        self.groups_per_batch = max(1, batch_size // k)
        self.device = next(model.parameters()).device
        self.cov: Coverage = plan_coverage(model)
        self.eos = eos_ids_of(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.eos)
        self.rank, self.world = rank_world()
        self.generator = torch.Generator(device=self.device).manual_seed(seed_for_rank(seed, self.rank))
        self.ctx = Context(model, tokenizer, self.device)
        self.progress = progress
        self.sums: ScoreSums | None = None
        self.token = TokenLevel(self) if any(o.token_level for o in objectives) else None
        self.samples: list[dict] = []
        self.checks: dict = {}

    def run(self, all_prompts: list[PromptRecord]) -> Calibration:
        prompts = shard(all_prompts, self.rank, self.world)  # this rank's share (all of them alone)
        rendered = [render_prompt(self.tokenizer, r) for r in prompts]
        for o in self.objectives:  # load a teacher, check data against the prompts
            o.prepare(self.ctx, all_prompts)  # all of them: finish() results must not depend on the rank
        total = len(prompts) * self.k
        bar_s = tqdm(total=total, desc="sampling", unit="sample", disable=not self.progress)
        bar_f = tqdm(total=total, desc="scoring ", unit="sample", disable=not self.progress)
        with bar_s, bar_f:
            for i in range(0, len(prompts), self.groups_per_batch):
                groups = self._sample(prompts[i : i + self.groups_per_batch], rendered[i : i + self.groups_per_batch])
                bar_s.update(len(groups) * self.k)
                signal = self._signals(groups)  # (O, B)
                batch = self._batch(groups)
                self._score(batch, signal)
                bar_f.update(len(groups) * self.k)
        if self.world > 1:
            self._merge_ranks()
        return self._result(len(all_prompts))

    def _sample(self, records, rendered) -> list[Group]:
        rows = [ids for ids in rendered for _ in range(self.k)]
        drawn = sample_responses(self.model, rows, eos_ids=self.eos, pad_id=self.pad,
                                 max_new_tokens=self.max_new_tokens, generator=self.generator)
        groups = []
        for g, (record, ids) in enumerate(zip(records, rendered)):
            part = drawn[g * self.k : (g + 1) * self.k]
            texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in part]
            groups.append(Group(record, ids, [s.response_ids for s in part], texts,
                                [s.logprob for s in part], [s.ended for s in part]))
        return groups

    def _signals(self, groups: list[Group]) -> torch.Tensor:
        """(O, B) sequence-level signals; token-level objectives contribute zeros here."""
        rows = []
        for o in self.objectives:
            parts = []
            for g in groups:
                out = o.signals(g, self.ctx)
                g.signals[o.name], g.values[o.name] = out.signal, out
                parts.append(out.signal)
            rows.append(torch.cat(parts))
        return torch.stack(rows).to(self.device)

    def _batch(self, groups: list[Group]) -> _Batch:
        rows, starts = [], []
        for g in groups:
            for resp in g.responses:
                rows.append(g.prompt_ids + resp)
                starts.append(len(g.prompt_ids))
        ids, mask = left_pad(rows, self.pad, self.device)
        resp = torch.zeros_like(ids, dtype=torch.bool)
        width = ids.shape[1]
        for b, (row, start) in enumerate(zip(rows, starts)):
            resp[b, width - len(row) + start :] = True
        return _Batch(ids, mask, resp, groups)

    def _score(self, batch: _Batch, signal: torch.Tensor) -> None:
        args = (self.model, batch.input_ids, batch.attention_mask, batch.response_mask)
        if self.sums is None:
            self.sums = score_sums(*args, signal, coverage=self.cov)
            if self.verify:
                self.checks["autograd"] = verify_against_autograd(*args, self.sums, self.cov)
        else:
            score_sums(*args, signal, coverage=self.cov, into=self.sums)
        if self.token is not None:
            self.token.add(batch)
        self._record(batch)

    def _record(self, batch: _Batch) -> None:
        for g in batch.groups:
            for k, resp in enumerate(g.responses):
                self.samples.append({
                    "prompt_index": g.record.index,
                    "prompt": g.record.prompt if g.record.prompt is not None else g.record.messages,
                    "prompt_ids": g.prompt_ids,
                    "response_ids": resp,
                    "response": g.texts[k],
                    "logprob": g.logprobs[k],
                    "truncated": not g.ended[k],
                    "signal": {name: float(s[k]) for name, s in g.signals.items()},
                    "value": {name: (v.values[k] if v.values else None) for name, v in g.values.items()},
                })

    def _merge_ranks(self) -> None:
        """Sum every rank's accumulators and merge statistics and samples (torchrun / accelerate)."""
        if self.sums is None:  # more ranks than prompt batches: this rank saw none
            self.sums = ScoreSums.zeros(self.cov, len(self.objectives))
        self.sums.count = all_reduce_int(self.sums.count, self.device)
        all_reduce_sums(self.sums.squares, self.sums.total, self.sums.signal)
        if self.token is not None:
            self.token.merge_ranks()
        for o in self.objectives:
            o.merge_statistics(gather_objects(o.statistics_state()))
        self.samples = [s for part in gather_objects(self.samples) for s in part]
        checks = [c for c in gather_objects(self.checks.get("autograd")) if c]
        if checks:
            self.checks["autograd"] = max(checks, key=lambda c: c["max_relative_error"])

    def _result(self, num_prompts: int) -> Calibration:
        n = self.sums.count
        fisher = {name: sq / n for name, sq in self.sums.squares.items()}
        score_mean = {name: t / n for name, t in self.sums.total.items()}
        results = []
        for i, o in enumerate(self.objectives):
            if o.token_level:
                grad = self.token.grad_estimate(o.name)
            else:
                grad = {name: s[i] / n for name, s in self.sums.signal.items()}
            results.append(ObjectiveResult(o.name, o.signal_scale, grad, o.summary()))
        self.checks["score_mean"] = score_mean_check(fisher, score_mean, n)
        cal = Calibration(fisher, score_mean, results, num_prompts, n,
                          sum(s["truncated"] for s in self.samples), self.samples,
                          self.cov.summary(), self.checks)
        if self.token is not None:
            cal.token_fisher = self.token.fisher()
        for o, r in zip(self.objectives, cal.objectives):  # results that need F (SFT from demonstrations)
            r.summary.update(o.finish(cal, self.ctx))
        return cal


def verify_against_autograd(model, input_ids, attention_mask, response_mask, sums: ScoreSums, cov: Coverage) -> dict:
    """Compare the engine's ``sum_n h_n`` with plain autograd of ``sum_n l_n``.

    A parameter used outside the module that holds it (a functional matmul with another
    module's weight) would be missed by the hooks; this catches it on the first batch.
    """
    params = {n: p for n, p in cov.params.items() if p.is_floating_point() and tuple(p.shape) == cov.shapes[n]}
    saved = {n: p.requires_grad for n, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        logp = response_logprobs(model, input_ids, attention_mask, response_mask)
        grads = torch.autograd.grad(logp.sum(), list(params.values()), allow_unused=True)
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])
    half = next(iter(params.values())).dtype in (torch.bfloat16, torch.float16) if params else False
    tol = 5e-2 if half else 1e-3
    worst, worst_name = 0.0, None
    for (name, _), g in zip(params.items(), grads):
        ref = torch.zeros(cov.shapes[name]) if g is None else g.float().cpu()
        mine = sums.total[name].cpu()
        err = float((mine - ref).norm() / (ref.norm() + mine.norm() + 1e-12))
        if err > worst:
            worst, worst_name = err, name
    if worst > tol:
        raise FisherSelectError(
            f"score sums for {worst_name} differ from autograd (relative error {worst:.2e} > {tol:g}): "
            "the parameter is probably used outside the module that holds it; please report this model"
        )
    return {"max_relative_error": worst, "parameter": worst_name, "tolerance": tol}


def score_mean_check(fisher, score_mean, n: int) -> dict:
    """z-scores of the score mean: RMS near 1 when samples follow the model (E[h] = 0)."""
    zsq, count = 0.0, 0
    for name, f in fisher.items():
        m = score_mean[name]
        var = (f - m.square()).clamp_min(0)  # per-sample variance of h
        ok = var > 0
        # z^2 = mean^2 / (var / n), vectorised with where() rather than boolean copies
        zsq += float(torch.where(ok, m.square() * n / torch.where(ok, var, 1.0), 0.0).sum(dtype=torch.float64))
        count += int(ok.sum())
    rms = math.sqrt(zsq / count) if count else float("nan")
    return {"rms_z": rms, "coordinates": count,
            "meaning": "RMS over coordinates of mean(h)/stderr; near 1 when E[h]=0 holds (samples from the model)"}


class TokenLevel:
    """Token-level Fisher and gradients for token-level objectives (full-vocabulary distillation).

    ``F^tok_i = E_y sum_t h_{t,i}^2`` from Rademacher signs: backprop of ``sum_t eps_t log pi(y_t|s_t)``
    has ``E_eps[(d_i u)^2] = sum_t h_{t,i}^2``, so the per-sample squares of one signed backward
    estimate it at the cost of the sequence Fisher (``sign_draws`` backwards reduce the noise).
    The gradient estimate ``mean_n sum_t A_t h_{n,t}`` is the plain score sum of one backward
    with token weights ``A_t``.
    """

    def __init__(self, cal: _Calibrator):
        self.cal = cal
        self.objectives = [o for o in cal.objectives if o.token_level]
        self.draws = max(o.sign_draws for o in self.objectives)
        seed = int(torch.randint(0, 2**62, (1,), generator=cal.generator, device=cal.device))
        self.signs = torch.Generator(device=cal.device).manual_seed(seed)
        self.squares: ScoreSums | None = None
        self.grads: dict[str, ScoreSums] = {}

    def add(self, batch: _Batch) -> None:
        args = (self.cal.model, batch.input_ids, batch.attention_mask, batch.response_mask)
        for _ in range(self.draws):
            eps = torch.randint(0, 2, batch.input_ids.shape, generator=self.signs, device=self.cal.device) * 2.0 - 1
            self.squares = score_sums(*args, token_weights=eps, coverage=self.cal.cov, into=self.squares)
        for o in self.objectives:
            weights = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.cal.device)
            rows = [t for g in batch.groups for t in g.values[o.name].extra["token_signal"]]
            for b, a in enumerate(rows):
                weights[b, batch.response_mask[b]] = a.to(weights)
            self.grads[o.name] = score_sums(*args, token_weights=weights, coverage=self.cal.cov,
                                            into=self.grads.get(o.name), squares=False)

    def merge_ranks(self) -> None:
        cal = self.cal
        if self.squares is None:
            self.squares = ScoreSums.zeros(cal.cov, None)
        self.squares.count = all_reduce_int(self.squares.count, cal.device)
        all_reduce_sums(self.squares.squares)
        for o in self.objectives:
            sums = self.grads.setdefault(o.name, ScoreSums.zeros(cal.cov, None, squares=False))
            sums.count = all_reduce_int(sums.count, cal.device)
            all_reduce_sums(sums.total)

    def fisher(self) -> dict[str, torch.Tensor]:
        n = self.squares.count  # samples x draws
        return {name: sq / n for name, sq in self.squares.squares.items()}

    def grad_estimate(self, name: str) -> dict[str, torch.Tensor]:
        sums = self.grads[name]
        return {k: t / sums.count for k, t in sums.total.items()}
