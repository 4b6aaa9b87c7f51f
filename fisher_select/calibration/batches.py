"""A calibration's batches: prompt groups sampled from the model (or read from rollouts), their signals, rows, records."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fisher_select.calibration.objectives import Group, GroupSignal, ScoringRow
from fisher_select.calibration.prompts import PromptRecord, check_context, render_prompt
from fisher_select.calibration.rollouts import Rollouts, tokenize_rollouts
from fisher_select.calibration.sampling import pad_rows, sample_responses
from fisher_select.calibration.teachers import sequence_logprobs


@dataclass
class Batch:
    """A scoring batch: prompt + response rows, left padded, with every objective's group signals."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    response_mask: torch.Tensor  # (B, T) True at response tokens
    groups: list[Group]
    signals: list[list[GroupSignal]]  # [objective][group]

    def sequence_signal(self, device) -> torch.Tensor:
        """(O, B) sequence-level signals; token-level objectives contribute zeros here."""
        return torch.stack([torch.cat([s.signal for s in row]) for row in self.signals]).to(device)

    @property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, mask, response mask), each (B, T)."""
        return self.input_ids, self.attention_mask, self.response_mask


class Groups:
    """Where a calibration's prompt groups come from: K responses sampled per prompt (plain ancestral
    sampling, in calls of at most ``sample_rows`` rows), or a rollouts file's responses."""

    def __init__(self, model, tokenizer, *, k: int, max_new_tokens: int, sample_rows: int, generator, eos, pad: int,
                 device, rollouts: Rollouts | None = None):
        self.model, self.tokenizer, self.k, self.max_new_tokens = model, tokenizer, k, max_new_tokens
        self.sample_rows, self.generator, self.eos, self.pad, self.device = sample_rows, generator, eos, pad, device
        self.rollouts = rollouts
        self.tokens, self.rollout_rows = {}, {}  # rollouts: each prompt's tokens and file rows

    def render(self, all_prompts: list[PromptRecord], truncate: bool) -> tuple[list[list[int]], int]:
        """Every prompt's token ids (all prompts: every rank agrees on the checks) and how many were cut."""
        if self.rollouts is not None:  # the file's tokens, checked against the model's vocabulary and context
            self.tokens = tokenize_rollouts(self.rollouts, self.model, self.tokenizer, self.eos)
            self.rollout_rows = {g.record.index: g.rows for g in self.rollouts.groups}
            return [self.tokens[r.index].prompt_ids for r in all_prompts], 0
        every = [render_prompt(self.tokenizer, r) for r in all_prompts]
        return check_context(self.model, all_prompts, every, self.max_new_tokens, truncate)

    def longest(self, rendered: list[list[int]]) -> int:
        """Tokens of the longest prompt + response (the memory estimate's)."""
        if self.rollouts is not None:  # the file's longest prompt + response
            return max((len(t.prompt_ids) + max(map(len, t.responses)) for t in self.tokens.values()), default=1)
        return max(map(len, rendered), default=0) + self.max_new_tokens

    def groups(self, records: list[PromptRecord], rendered: list[list[int]]) -> list[Group]:
        if not records:  # fsdp: a rank past its own prompts
            return []
        return self._rollout_groups(records) if self.rollouts is not None else self._sample(records, rendered)

    def _rollout_groups(self, records: list[PromptRecord]) -> list[Group]:
        """The file's groups, with this model's log-probability of every response recomputed (fp32, summed)."""
        toks = [self.tokens[r.index] for r in records]
        contexts = [t.prompt_ids for t in toks for _ in t.responses]
        logp = sequence_logprobs(self.model, contexts, [y for t in toks for y in t.responses]).tolist()  # (B,)
        groups, at = [], 0
        for r, t in zip(records, toks):
            k = len(t.responses)
            groups.append(Group(r, t.prompt_ids, t.responses, t.texts, logp[at : at + k], t.ended,
                                rollout=self.rollout_rows[r.index]))
            at += k
        return groups

    def _sample(self, records, rendered) -> list[Group]:
        rows = [ids for ids in rendered for _ in range(self.k)]
        drawn = []  # in calls of at most sample_rows rows: one call unless K exceeds the batch size
        for start in range(0, len(rows), self.sample_rows):
            drawn += sample_responses(self.model, rows[start : start + self.sample_rows], eos_ids=self.eos,
                                      pad_id=self.pad, max_new_tokens=self.max_new_tokens, generator=self.generator)
        groups = []
        for g, (record, ids) in enumerate(zip(records, rendered)):
            part = drawn[g * self.k : (g + 1) * self.k]
            texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in part]
            groups.append(Group(record, ids, [s.response_ids for s in part], texts,
                                [s.logprob for s in part], [s.ended for s in part]))
        return groups

    def batch(self, groups: list[Group], signals: list[list[GroupSignal]]) -> Batch:
        rows = [ScoringRow(g.prompt_ids + resp, len(g.prompt_ids)) for g in groups for resp in g.responses]
        return Batch(*pad_rows(rows, self.pad, self.device), groups, signals)


def signals(objectives, stats, groups: list[Group], ctx) -> list[list[GroupSignal]]:
    """[objective][group] signals, each folded into that objective's statistics."""
    out = []
    for o, st in zip(objectives, stats):
        row = [o.signals(g, ctx) for g in groups]
        for s in row:
            st.add(s)
        out.append(row)
    return out


def records(batch: Batch, names: list[str]) -> list[dict]:
    """One sample record per response of ``batch`` (``names``: the objectives')."""
    out = []
    for j, g in enumerate(batch.groups):
        sig = [row[j] for row in batch.signals]  # this group's, per objective
        for k, resp in enumerate(g.responses):
            out.append({
                "prompt_index": g.record.index,
                "prompt": g.record.prompt if g.record.prompt is not None else g.record.messages,
                "prompt_ids": g.prompt_ids,
                "response_ids": resp,
                "response": g.texts[k],
                "logprob": g.logprobs[k],
                "truncated": not g.ended[k],
                "signal": {name: float(s.signal[k]) for name, s in zip(names, sig)},
                "value": {name: (s.values[k] if s.values else None) for name, s in zip(names, sig)},
                **({"sampler_logprob": g.rollout[k].sampler_logprob, "rollout_line": g.rollout[k].line}
                   if g.rollout else {}),
            })
    return out


def row_chunks(batch: Batch, rows: int):
    """``batch`` in parts of at most ``rows`` rows. Only a batch of one prompt (K above the batch size) is
    ever larger: its group and signals are cut along the K responses; a smaller batch passes whole."""
    if batch.input_ids.shape[0] <= rows:
        yield batch
        return
    (group,), cut = batch.groups, dataclasses.replace
    for a in range(0, batch.input_ids.shape[0], rows):
        b = a + rows
        part = cut(group, responses=group.responses[a:b], texts=group.texts[a:b], logprobs=group.logprobs[a:b],
                   ended=group.ended[a:b], rollout=group.rollout[a:b])
        sig = [[cut(s, signal=s.signal[a:b], values=s.values[a:b],
                    token_signal=None if s.token_signal is None else s.token_signal[a:b])] for (s,) in batch.signals]
        yield Batch(batch.input_ids[a:b], batch.attention_mask[a:b], batch.response_mask[a:b], [part], sig)
