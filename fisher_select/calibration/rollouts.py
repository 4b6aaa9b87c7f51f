"""Bring your own rollouts: responses already sampled (by a trainer, a server, an earlier run) to score.

``calibrate --rollouts FILE`` skips sampling. Every row names a prompt and one response; rows
are grouped by prompt (K responses each: the leave-one-out baselines need them). The model's
own log-probability of every response is recomputed; where the row carries the sampler's, the
two are compared, since rollouts from another policy or a stale checkpoint estimate another
Fisher (MATH.md: the model Fisher needs the model's own samples). docs/ROLLOUTS.md gives the
field mapping of plain JSONL files, TRL's GRPO logs and this tool's own samples.jsonl.

The file is checked in two passes, each raising one error that lists every problem: its
structure (``load_rollouts``, before any model is loaded) and its tokens against the model's
tokenizer and context (``tokenize_rollouts``).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fisher_select.calibration.prompts import PromptRecord, context_length, render_prompt
from fisher_select.errors import FisherSelectError

# Aliases: TRL and plain prompt/completion files say "completion"; this tool's samples.jsonl
# says "logprob" for the log-probability its own sampler computed.
PROMPT_KEYS = ("prompt_ids", "prompt", "messages")
RESPONSE_KEYS = ("response_ids", "completion_ids", "response", "completion")
SAMPLER_KEYS = ("sampler_logprob", "logprob", "sampler_token_logprobs")
MAX_LISTED = 40  # problems named in the error; the rest are counted
# A response is off-policy when |sampler - model| log-probability exceeds this, per token
# (fp32 recomputation of the same model differs by ~1e-6; bf16 samplers by ~1e-2 per token).
MISMATCH_PER_TOKEN = 1e-3
FORMATS = ("jsonl", "parquet")


@dataclass
class RolloutRow:
    """One row of the file: a prompt, one response and what the file says about it."""

    line: int  # 1-based line (JSONL) or row (Parquet) number
    prompt: str | None = None
    messages: list | None = None
    prompt_ids: list[int] | None = None
    response: str | None = None
    response_ids: list[int] | None = None
    reward: float | dict | None = None  # a number, or objective name -> number
    teacher_logprob: float | dict | None = None  # log T(y|x), summed; or objective name -> number
    sampler_logprob: float | None = None  # the sampler's log-probability of the response, summed
    sampler_tokens: int | None = None  # how many per-token sampler log-probs the row gave
    truncated: bool | None = None
    prompt_index: int | None = None
    fields: dict = field(default_factory=dict)  # every key of the row (rewards read answers from here)

    def key(self) -> str:
        """The group key: the prompt's index if given, else its exact content."""
        if self.prompt_index is not None:
            return f"index:{self.prompt_index}"
        return json.dumps([self.prompt_ids, self.prompt, self.messages], sort_keys=True)


@dataclass
class RolloutGroup:
    """The K rows of one prompt, in file order; ``record.index`` orders and halves the prompts."""

    record: PromptRecord
    rows: list[RolloutRow]


@dataclass
class Rollouts:
    """A validated rollout file: prompt groups of K rows each."""

    path: Path
    groups: list[RolloutGroup]
    k: int
    sha256: str
    num_rows: int
    prompts_in_file: int

    @property
    def prompts(self) -> list[PromptRecord]:
        return [g.record for g in self.groups]

    def describe(self) -> dict:
        return {"method": "rollouts", "file": str(self.path), "sha256": self.sha256, "rows": self.num_rows,
                "prompts": len(self.groups), "prompts_in_file": self.prompts_in_file, "samples_per_prompt": self.k}


# ---------------------------------------------------------------------------
# Reading and checking the structure


def load_rollouts(path, limit: int | None = None) -> Rollouts:
    """Read and check a rollout file (JSONL, or Parquet with pyarrow); ``limit``: first prompts only."""
    path = Path(path)
    if not path.is_file():
        raise FisherSelectError(f"rollout file {path} does not exist; pass a JSONL (or Parquet) file of rollouts "
                                "(docs/ROLLOUTS.md)")
    problems: list[str] = []
    rows = [r for r in (_parse_row(obj, line, problems) for line, obj in _read_objects(path, problems)) if r]
    if not rows and not problems:
        problems.append("no rows: give one JSON object per line with a prompt and a response")
    groups = _group(rows, problems)
    in_file = len(groups)
    if limit is not None:
        groups = groups[:limit]
    k = _common_k(groups, problems)
    if problems:
        raise FisherSelectError(_problem_text(path, problems))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Rollouts(path, groups, k, digest, sum(len(g.rows) for g in groups), in_file)


def _problem_text(path: Path, problems: list[str]) -> str:
    problems = sorted(problems, key=_line_of)  # in file order, whichever check found them
    shown = "; ".join(problems[:MAX_LISTED])
    more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return (f"rollout file {path} has {len(problems)} problem(s): {shown}{more}; fix these rows "
            "(field mapping: docs/ROLLOUTS.md)")


def _line_of(problem: str) -> int:
    m = re.match(r"line (\d+):", problem)
    return int(m.group(1)) if m else 0


def _read_objects(path: Path, problems: list[str]):
    """(line number, object) pairs of a JSONL or Parquet file; unreadable lines become problems."""
    if path.suffix.lower() in (".parquet", ".pq"):
        yield from _read_parquet(path)
        return
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig")
            except UnicodeDecodeError:
                problems.append(f"line {line}: not valid UTF-8 (save the file as UTF-8)")
                continue
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as err:
                problems.append(f"line {line}: invalid JSON ({err.msg})")


def _read_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FisherSelectError(
            f"rollout file {path} is Parquet but pyarrow is not installed; `pip install pyarrow`, or convert it "
            "to JSONL (one JSON object per row)") from None
    table = pq.read_table(path)
    for i, obj in enumerate(table.to_pylist(), start=1):
        yield i, obj


def _parse_row(obj, line: int, problems: list[str]) -> RolloutRow | None:
    """One row, or None with its problems appended (each names the line and the field)."""
    if not isinstance(obj, dict):
        problems.append(f"line {line}: got {type(obj).__name__}, expected a JSON object")
        return None
    before = len(problems)
    row = RolloutRow(line, fields=obj)
    _prompt_of(obj, row, problems)
    _response_of(obj, row, problems)
    _values_of(obj, row, problems)
    return row if len(problems) == before else None


def _prompt_of(obj: dict, row: RolloutRow, problems: list[str]) -> None:
    at = f"line {row.line}"
    if not any(obj.get(k) is not None for k in PROMPT_KEYS):
        problems.append(f'{at}: no prompt: give "prompt" (text or chat messages), "messages" or "prompt_ids"')
        return
    if obj.get("prompt_ids") is not None:  # exact tokens win over text (this tool's samples.jsonl has both)
        row.prompt_ids = _token_ids(obj["prompt_ids"], f'{at}: "prompt_ids"', problems)
    prompt = obj.get("prompt", obj.get("messages"))
    if isinstance(prompt, str):
        row.prompt = prompt if prompt.strip() or row.prompt_ids else _empty(f'{at}: "prompt"', problems)
    elif isinstance(prompt, list):
        row.messages = _messages(prompt, f"{at}: prompt messages", problems)
    elif prompt is not None:
        problems.append(f'{at}: "prompt" is {type(prompt).__name__}; expected text or a list of chat messages')
    if obj.get("prompt_index") is not None:
        index = obj["prompt_index"]
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            problems.append(f'{at}: "prompt_index" is {index!r}; expected a non-negative integer')
        else:
            row.prompt_index = index


def _response_of(obj: dict, row: RolloutRow, problems: list[str]) -> None:
    at = f"line {row.line}"
    ids = next((k for k in ("response_ids", "completion_ids") if obj.get(k) is not None), None)
    text = next((k for k in ("response", "completion") if obj.get(k) is not None), None)
    if ids is None and text is None:
        problems.append(f'{at}: no response: give "response" / "completion" (text) or "response_ids" (token ids)')
        return
    if ids is not None:
        row.response_ids = _token_ids(obj[ids], f'{at}: "{ids}"', problems)
    if text is not None:
        row.response = _response_text(obj[text], f'{at}: "{text}"', problems)


def _response_text(value, where: str, problems: list[str]) -> str | None:
    """Text, or TRL's conversational completion: a list with one assistant message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) \
            and isinstance(value[0].get("content"), str):
        return value[0]["content"]
    problems.append(f"{where} is {type(value).__name__}; expected text or one assistant message")
    return None


def _values_of(obj: dict, row: RolloutRow, problems: list[str]) -> None:
    at = f"line {row.line}"
    row.reward = _number_or_map(obj.get("reward"), f'{at}: "reward"', problems)
    teacher = obj.get("teacher_logprob")
    if obj.get("teacher_token_logprobs") is not None:
        tokens = _numbers(obj["teacher_token_logprobs"], f'{at}: "teacher_token_logprobs"', problems, allow_inf=True)
        teacher = math.fsum(tokens) if tokens is not None else None
    row.teacher_logprob = _number_or_map(teacher, f'{at}: "teacher_logprob"', problems, allow_inf=True)
    _sampler_of(obj, row, problems)
    if obj.get("truncated") is not None:
        if not isinstance(obj["truncated"], bool):
            problems.append(f'{at}: "truncated" is {obj["truncated"]!r}; expected true or false')
        else:
            row.truncated = obj["truncated"]


def _sampler_of(obj: dict, row: RolloutRow, problems: list[str]) -> None:
    at = f"line {row.line}"
    if obj.get("sampler_token_logprobs") is not None:
        tokens = _numbers(obj["sampler_token_logprobs"], f'{at}: "sampler_token_logprobs"', problems)
        if tokens is not None:
            row.sampler_logprob, row.sampler_tokens = math.fsum(tokens), len(tokens)
        return
    key = "sampler_logprob" if obj.get("sampler_logprob") is not None else "logprob"
    value = obj.get(key)
    if value is not None:
        if not _is_number(value) or not math.isfinite(value) or value > 1e-6:
            problems.append(f'{at}: "{key}" is {value!r}; expected a finite log-probability <= 0')
        else:
            row.sampler_logprob = float(value)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _number_or_map(value, where: str, problems: list[str], allow_inf: bool = False):
    """A finite number, or a mapping objective name -> finite number (None passes)."""
    def ok(v):
        return _is_number(v) and (math.isfinite(v) or (allow_inf and v == -math.inf))

    if value is None:
        return None
    if ok(value):
        return float(value)
    if isinstance(value, dict) and value and all(isinstance(k, str) and ok(v) for k, v in value.items()):
        return {k: float(v) for k, v in value.items()}
    problems.append(f"{where} is {value!r}; expected a finite number or a mapping objective name -> number")
    return None


def _numbers(value, where: str, problems: list[str], allow_inf: bool = False) -> list[float] | None:
    if isinstance(value, list) and value and all(_is_number(v) and (math.isfinite(v) or (allow_inf and v == -math.inf))
                                                 for v in value):
        return [float(v) for v in value]
    problems.append(f"{where} must be a non-empty list of finite numbers, one per response token")
    return None


def _token_ids(value, where: str, problems: list[str]) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                 for v in value):
        return list(value)
    problems.append(f"{where} must be a non-empty list of non-negative integer token ids")
    return None


def _messages(value: list, where: str, problems: list[str]) -> list | None:
    ok = value and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in value)
    if ok:
        return value
    problems.append(f'{where} must be a non-empty list of {{"role", "content"}} objects with string values')
    return None


def _empty(where: str, problems: list[str]) -> None:
    problems.append(f"{where} is empty; give the prompt text")
    return None


# ---------------------------------------------------------------------------
# Grouping by prompt


def _group(rows: list[RolloutRow], problems: list[str]) -> list[RolloutGroup]:
    """Groups in the order of their prompt index (given) or of first appearance in the file."""
    indexed = {r.prompt_index is not None for r in rows}
    if len(indexed) > 1:
        problems.append('"prompt_index" is given on some rows but not others: give it on every row or on none')
        return []
    by_key: dict[str, list[RolloutRow]] = {}
    for r in rows:
        by_key.setdefault(r.key(), []).append(r)
    groups = []
    for n, (key, members) in enumerate(by_key.items()):
        first = members[0]
        _same_prompt(members, problems)
        index = first.prompt_index if first.prompt_index is not None else n
        record = PromptRecord(index, first.prompt, first.messages, first.fields)
        groups.append(RolloutGroup(record, members))
    return sorted(groups, key=lambda g: g.record.index)


def _same_prompt(members: list[RolloutRow], problems: list[str]) -> None:
    first = members[0]
    for r in members[1:]:
        if (r.prompt_ids, r.prompt, r.messages) != (first.prompt_ids, first.prompt, first.messages):
            problems.append(f"line {r.line}: prompt_index {r.prompt_index} names another prompt than on line "
                            f"{first.line}; one index per prompt")


def _common_k(groups: list[RolloutGroup], problems: list[str]) -> int:
    """Every prompt must have the same number of responses K (batches hold whole groups of K)."""
    sizes: dict[int, list[RolloutGroup]] = {}
    for g in groups:
        sizes.setdefault(len(g.rows), []).append(g)
    if len(sizes) > 1:
        k = max(sizes, key=lambda s: len(sizes[s]))
        for size, gs in sorted(sizes.items()):
            if size != k:
                lines = ", ".join(str(g.rows[0].line) for g in gs[:5])
                problems.append(f"{len(gs)} prompt(s) have {size} responses where most have {k} (first rows on lines "
                                f"{lines}): give every prompt the same number of responses")
        return k
    k = next(iter(sizes), 0)
    if k == 1 and groups:
        problems.append("every prompt has a single response; centred signals (rl, opd-pg) need K >= 2 per prompt: "
                        "rows with the same prompt form its group")
    return k


# ---------------------------------------------------------------------------
# Tokens, against the model's tokenizer and context


@dataclass
class TokenizedGroup:
    """A group's prompt ids, response ids, EOS flags and texts, ready for the calibrator."""

    prompt_ids: list[int]
    responses: list[list[int]]
    ended: list[bool]
    texts: list[str]


def tokenize_rollouts(rollouts: Rollouts, model, tokenizer, eos_ids: set[int]) -> dict[int, TokenizedGroup]:
    """Every group's tokens by prompt index; one error listing every row that does not fit the model."""
    problems: list[str] = []
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    limit = context_length(model)
    out = {}
    for g in rollouts.groups:
        prompt_ids = _prompt_ids(g, tokenizer, problems)
        rows = [_response_tokens(r, tokenizer, eos_ids, problems) for r in g.rows]
        for r, (ids, _, _) in zip(g.rows, rows):
            _fits(r, (prompt_ids or []) + ids, vocab, limit, problems)
        out[g.record.index] = TokenizedGroup(prompt_ids or [], *(list(x) for x in zip(*rows)))
    if problems:
        raise FisherSelectError(_problem_text(rollouts.path, problems))
    return out


def _prompt_ids(g: RolloutGroup, tokenizer, problems: list[str]) -> list[int] | None:
    row = g.rows[0]
    if row.prompt_ids is not None:
        return row.prompt_ids
    try:
        return render_prompt(tokenizer, g.record)
    except FisherSelectError as err:
        problems.append(f"line {row.line}: {err}")
        return None


def _response_tokens(r: RolloutRow, tokenizer, eos_ids: set[int], problems: list[str]):
    """(ids, ended, text). Text responses are tokenized without special tokens, and the EOS their
    decoding dropped is put back unless the row says it was truncated (docs/ROLLOUTS.md)."""
    if r.response_ids is not None:
        ids = r.response_ids
        ended = ids[-1] in eos_ids
        if r.truncated is not None and r.truncated == ended:
            problems.append(f'line {r.line}: "truncated" is {r.truncated} but the response '
                            f"{'ends' if ended else 'does not end'} with EOS")
    else:
        ids = list(tokenizer(r.response, add_special_tokens=False)["input_ids"]) if _takes_special(tokenizer) \
            else list(tokenizer(r.response)["input_ids"])
        ended = not r.truncated
        if ended and (not ids or ids[-1] not in eos_ids):
            ids = ids + [min(eos_ids)]
    if not ids:
        problems.append(f"line {r.line}: the response is empty and marked truncated: nothing to score")
    if r.sampler_tokens is not None and r.sampler_tokens != len(ids):
        problems.append(f'line {r.line}: "sampler_token_logprobs" has {r.sampler_tokens} entries but the response '
                        f"has {len(ids)} tokens (EOS included when it ended); give one per response token")
    text = r.response if r.response is not None else tokenizer.decode(ids, skip_special_tokens=True)
    return ids, ended, text


def _takes_special(tokenizer) -> bool:
    try:
        tokenizer("", add_special_tokens=False)
    except TypeError:
        return False
    return True


def _fits(r: RolloutRow, ids: list[int], vocab: int | None, limit: int | None, problems: list[str]) -> None:
    if vocab is not None and ids and max(ids) >= vocab:
        problems.append(f"line {r.line}: token id {max(ids)} is outside the model's vocabulary of {vocab}: "
                        "rollouts from another tokenizer cannot be scored")
    if limit is not None and len(ids) > limit:
        problems.append(f"line {r.line}: prompt + response are {len(ids)} tokens, past the model's context of {limit}")


# ---------------------------------------------------------------------------
# What objectives read from the rows, and the on-policy check


def row_value(value: float | dict | None, objective: str) -> float | None:
    """The row's number for ``objective`` (a bare number applies to every objective)."""
    if isinstance(value, dict):
        return value.get(objective)
    return value


def given_values(group, kind: str, objective: str) -> list[float] | None:
    """Per response of an objectives.Group, the file's ``kind`` ("reward" or "teacher_logprob") for
    ``objective``; None when the group did not come from a file or the file has none for it."""
    rows = getattr(group, "rollout", None)
    if not rows:
        return None
    values = [row_value(getattr(r, kind), objective) for r in rows]
    if kind == "reward" and all(v is None for v in values):  # this tool's samples.jsonl: value.<objective>
        values = [_number(r.fields.get("value"), objective) for r in rows]
    if all(v is None for v in values):
        return None
    lacking = [r.line for r, v in zip(rows, values) if v is None]  # the rows without one, not the group's first
    if lacking:
        lines = ", ".join(map(str, lacking))
        raise FisherSelectError(f"{group.record.describe()}: some rows give a {kind} for {objective!r} and some do not "
                                f"(no {kind} on line(s) {lines}); give it on every row or on none")
    return values


def _number(value, key: str) -> float | None:
    v = value.get(key) if isinstance(value, dict) else None
    return float(v) if _is_number(v) else None


def mismatch_summary(samples: list[dict]) -> dict:
    """The on-policy check from the sample records: model vs sampler log-probability, per response and overall.

    ``kl_estimate`` = mean(sampler - model) estimates KL(sampler || model) when the rows were drawn from
    the sampler; ``importance_ess`` is the effective sample size fraction of weights model/sampler.
    """
    pairs = [(s["sampler_logprob"], s["logprob"], len(s["response_ids"])) for s in samples
             if s.get("sampler_logprob") is not None]
    out = {"responses": len(samples), "with_sampler_logprob": len(pairs), "tolerance_per_token": MISMATCH_PER_TOKEN}
    if not pairs:
        return {**out, "verdict": "unchecked"}
    delta = torch.tensor([q - p for q, p, _ in pairs], dtype=torch.float64)  # (M,) log q - log p
    lengths = torch.tensor([n for _, _, n in pairs], dtype=torch.float64)
    off = delta.abs() > MISMATCH_PER_TOKEN * lengths
    log_w = -delta  # log(model / sampler)
    ess = float(torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)) / len(pairs))
    return {**out, "mean_abs_mismatch": float(delta.abs().mean()), "max_abs_mismatch": float(delta.abs().max()),
            "mean_abs_mismatch_per_token": float((delta.abs() / lengths).mean()),
            "off_policy_responses": int(off.sum()), "kl_estimate": float(delta.mean()), "importance_ess": ess,
            "verdict": "off-policy" if bool(off.any()) else "on-policy"}
