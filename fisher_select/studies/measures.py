"""Forward-only measures of the outcome study: what an arm learned (content, format) and what it broke.

- ``general_text_nll``: mean NLL per token of general English prose shipped with the package
  (``data/general_english.txt``, written for this purpose; the task never shows it): forgetting.
- ``answer_nll``: per prompt, the NLL of the answer's tokens alone after the rendered prompt (no
  end-of-sequence token, no formatting): the content of the task without its format.
- ``greedy_correct``: per prompt, 1.0 when the last number of the greedy answer equals the answer.
- ``general_responses`` / ``general_kl``: forgetting as the KL from the starting model on its own
  responses to general prompts (``data/general_prompts.txt``, written for this purpose): the
  responses are sampled once from the starting model, with a fixed seed, and every arm is scored on
  those same responses (common random numbers); per token, sum(log p_0(y) - log p(y)) / tokens, an
  unbiased estimate of KL(p_0 || p) per response token (0 at the start; forward-only).
- ``freeze_teacher``: a frozen copy of the starting model as a ``model: self`` teacher or
  demonstrator, so that distillation's target does not move while the student trains.

Every log-probability is an fp32 log-softmax, summed in fp32 (``engine.logprob``).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from fisher_select.calibration.objectives.base import ScoringRow
from fisher_select.calibration.prompts import PromptRecord, render_prompt
from fisher_select.calibration.rewards import last_number
from fisher_select.calibration.sampling import eos_ids_of, pad_id_of, pad_rows, sample_responses
from fisher_select.calibration.config import SELF
from fisher_select.calibration.teachers import Teacher, TeacherConfig
from fisher_select.engine.logprob import response_logprobs
from fisher_select.studies.prefix import greedy, row_logprobs

GENERAL_TEXT = Path(__file__).with_name("data") / "general_english.txt"
GENERAL_PROMPTS = Path(__file__).with_name("data") / "general_prompts.txt"
GENERAL_SEED = 5_000_011  # the general prompts' sampling seed (+ the replicate's seed)
GENERAL_NEW_TOKENS = 32


@torch.no_grad()
def general_text_nll(model, tokenizer, text: str | None = None, window: int = 256) -> float:
    """Mean negative log-likelihood per predicted token of ``text`` (default: the shipped prose), in
    windows of ``window`` tokens (each window's first token is context only)."""
    text = GENERAL_TEXT.read_text(encoding="utf-8") if text is None else text
    ids = list(tokenizer(text)["input_ids"])
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(ids) - 1, window - 1):
        chunk = ids[i : i + window]
        if len(chunk) < 2:
            break
        rows = [ScoringRow(chunk, 1)]  # every token after the first is scored
        padded, mask, resp = pad_rows(rows, 0, device)  # (1, T) each
        total -= float(response_logprobs(model, padded, mask, resp).sum())
        count += len(chunk) - 1
    return total / count


@torch.no_grad()
def general_responses(model, tokenizer, seed: int, prompts: list[str] | None = None,
                      max_new_tokens: int = GENERAL_NEW_TOKENS, samples: int = 2) -> tuple[list, list[float]]:
    """The starting model's own responses to general prompts (``samples`` per prompt, sampled once with
    ``seed``) as scoring rows, and their log-probabilities under it: the reference ``general_kl`` needs."""
    if prompts is None:
        prompts = [p for p in GENERAL_PROMPTS.read_text(encoding="utf-8").splitlines() if p.strip()]
    rendered = [render_prompt(tokenizer, PromptRecord(i, p, None, {"prompt": p})) for i, p in enumerate(prompts)]
    rendered = [ids for ids in rendered for _ in range(samples)]
    device = next(model.parameters()).device
    pad = pad_id_of(model, tokenizer)
    gen = torch.Generator(device=device).manual_seed(GENERAL_SEED + seed)
    drawn = sample_responses(model, rendered, eos_ids=eos_ids_of(model, tokenizer), pad_id=pad,
                             max_new_tokens=max_new_tokens, generator=gen)
    rows = [ScoringRow(ids + s.response_ids, len(ids)) for ids, s in zip(rendered, drawn) if s.response_ids]
    return rows, row_logprobs(model, rows, pad, device)


@torch.no_grad()
def general_kl(model, rows: list, start_logprobs: list[float], pad_id: int) -> float:
    """Per response token: sum over rows of (log p_0(y) - log p(y)) / tokens, on the starting model's responses."""
    now = row_logprobs(model, rows, pad_id, next(model.parameters()).device)
    tokens = sum(len(r.ids) - r.start for r in rows)
    return (sum(start_logprobs) - sum(now)) / tokens


def _answer_text(record: PromptRecord, field: str) -> str:
    value = record.fields[field]
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


@torch.no_grad()
def answer_nll(model, tokenizer, records: list[PromptRecord], field: str = "answer", micro: int = 8) -> list[float]:
    """Per prompt: the summed NLL of the answer's tokens right after the rendered prompt."""
    rows = []
    for r in records:
        prompt = render_prompt(tokenizer, r)
        answer = list(tokenizer(_answer_text(r, field), add_special_tokens=False)["input_ids"])
        rows.append(ScoringRow(prompt + answer, len(prompt)))
    pad, device = pad_id_of(model, tokenizer), next(model.parameters()).device
    return [-x for x in row_logprobs(model, rows, pad, device, micro)]  # the shared prefix once


@torch.no_grad()
def greedy_correct(model, tokenizer, records: list[PromptRecord], max_new_tokens: int, field: str = "answer",
                   micro: int = 8) -> list[float]:
    """Per prompt: 1.0 when the greedy response's last number equals the answer, else 0.0."""
    eos, pad = eos_ids_of(model, tokenizer), pad_id_of(model, tokenizer)
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(records), micro):
        part = records[i : i + micro]
        responses = greedy(model, [render_prompt(tokenizer, r) for r in part], max_new_tokens, eos, pad, device)
        for r, resp in zip(part, responses):
            got = last_number(tokenizer.decode(resp, skip_special_tokens=True))
            want = float(r.fields[field])
            out.append(float(got is not None and math.isclose(got, want, abs_tol=1e-9)))
    return out


def freeze_teacher(objective, model, tokenizer):
    """Replace a ``model: self`` teacher (or demonstrator) of ``objective`` by a frozen copy of ``model``
    as it is now (eval mode, no gradients), under the same privileged context; the copy, or None when
    the objective has no such teacher. Call it before training, on the starting model."""
    spec = getattr(objective, "spec", None)
    if not isinstance(spec, TeacherConfig) or spec.model != SELF:
        return None
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    objective.spec = Teacher(frozen, tokenizer, spec.system_prompt, spec.user_template,
                             name=f"the frozen {objective.role} (a copy of the starting model under its context)")
    objective.teacher = None  # resolved again from the frozen spec by prepare()
    return frozen
