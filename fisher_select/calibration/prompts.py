"""Prompt and demonstration files (JSONL), and turning a prompt into the token ids the model continues."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fisher_select.errors import FisherSelectError

_EXPECTED = 'expected a JSON object with "prompt" (a string) or "messages" (a list of {"role", "content"})'


@dataclass
class PromptRecord:
    """One prompt; ``fields`` keeps the whole JSON object (answers etc. for rewards)."""

    index: int  # 0-based line index in the file (blank lines count, so it finds the line)
    prompt: str | None
    messages: list[dict] | None
    fields: dict

    def preview(self, n: int = 60) -> str:
        """The first ``n`` characters of the prompt text, for error messages."""
        text = self.prompt if self.prompt is not None else _last_content(self.messages)
        return text[:n]

    def describe(self) -> str:
        """How error messages name this prompt: index, file line and the text's start."""
        return f"prompt {self.index} (line {self.index + 1}: {self.preview()!r})"


def _last_content(messages: list[dict] | None) -> str:
    return str(messages[-1].get("content", "")) if messages else ""


def load_prompts(path, limit: int | None = None) -> list[PromptRecord]:
    """Read a JSONL prompt file; ``limit`` keeps only the first ``limit`` prompts."""
    path = Path(path)
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise FisherSelectError(f"prompt limit {limit!r} is not a positive integer; pass e.g. 64")
    if not path.is_file():
        raise FisherSelectError(f"prompt file {path} does not exist; pass a JSONL file of prompts")
    records: list[PromptRecord] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            line = _decode(raw, path, lineno)
            if line.strip():
                records.append(_parse_line(line, path, lineno))
    if not records:
        raise FisherSelectError(f"prompt file {path} has no prompts; {_EXPECTED} per line")
    if limit is not None and len(records) < limit:
        raise FisherSelectError(f"{limit} prompts were asked for (num_prompts) but {path} has only {len(records)}; "
                                f"pass --num-prompts {len(records)} or fewer, or add prompts to the file")
    return records


def load_demonstrations(path: Path) -> list[PromptRecord]:
    """Demonstration lines: a prompt (``prompt`` or ``messages``) and a ``response`` string."""
    if not Path(path).is_file():
        raise FisherSelectError(
            f"demonstrations file {path} does not exist; give a JSONL file of prompt + response lines")
    demos = load_prompts(path)
    for d in demos:
        if not isinstance(d.fields.get("response"), str):
            raise FisherSelectError(f"{path}:{d.index + 1}: needs a \"response\" string (the demonstrated answer)")
    return demos


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8-sig")  # tolerate a BOM from Windows editors
    except UnicodeDecodeError:
        raise FisherSelectError(f"{path}:{lineno}: not valid UTF-8; save the file as UTF-8") from None


def _parse_line(line: str, path: Path, lineno: int) -> PromptRecord:
    where, index = f"{path}:{lineno}", lineno - 1
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise FisherSelectError(f"{where}: invalid JSON ({err.msg}); {_EXPECTED}") from None
    if not isinstance(obj, dict):
        raise FisherSelectError(f"{where}: got {type(obj).__name__}; {_EXPECTED}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        got = "both" if has_prompt else "neither"
        raise FisherSelectError(f'{where}: has {got} of "prompt" and "messages"; give exactly one')
    if has_prompt:
        return PromptRecord(index, _check_prompt(obj["prompt"], where), None, obj)
    return PromptRecord(index, None, _check_messages(obj["messages"], where), obj)


def _check_prompt(prompt, where: str) -> str:
    if not isinstance(prompt, str):
        raise FisherSelectError(f'{where}: "prompt" is {type(prompt).__name__}; expected a string')
    if not prompt.strip():
        raise FisherSelectError(f'{where}: "prompt" is empty; give the prompt text')
    return prompt


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise FisherSelectError(
            f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects'
        )
    for i, msg in enumerate(messages):
        ok = isinstance(msg, dict) and all(isinstance(msg.get(k), str) for k in ("role", "content"))
        if not ok:
            raise FisherSelectError(
                f'{where}: messages[{i}] must be an object with string "role" and "content"'
            )
    return messages


def render_prompt(tokenizer, record: PromptRecord) -> list[int]:
    """Token ids of the prompt, ready for generation.

    With a chat template, the conversation (a bare ``prompt`` becomes one user turn)
    is rendered with the assistant's generation prompt appended; without one, the
    plain prompt text is tokenized.
    """
    where = record.describe()
    if getattr(tokenizer, "chat_template", None):
        messages = record.messages or [{"role": "user", "content": record.prompt}]
        ids = _apply_template(tokenizer, messages, where)
    elif record.messages is not None:
        raise FisherSelectError(
            f"{where} has \"messages\" but the tokenizer has no chat template; "
            'use "prompt" strings or a model with a chat template'
        )
    else:
        ids = list(tokenizer(record.prompt)["input_ids"])
    if not ids:
        raise FisherSelectError(f"{where} renders to no tokens; give a non-empty prompt")
    return ids


def _apply_template(tokenizer, messages: list[dict], where: str) -> list[int]:
    # transformers 5 returns a BatchEncoding by default (4.x returned a list); ask for
    # the dict form explicitly so both versions give the same shape.
    try:
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except Exception as err:  # jinja templates raise their own error types
        raise FisherSelectError(
            f"{where}: the tokenizer's chat template rejected the messages ({err}); "
            "fix the roles/order of the messages"
        ) from err
    ids = out["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one conversation
        ids = ids[0]
    return [int(i) for i in ids]


def context_length(model) -> int | None:
    """The positions the model was built for (learned positions or RoPE's trained range); None if unknown."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model.config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(model, records: list[PromptRecord], rendered: list[list[int]], max_new_tokens: int,
                  truncate: bool = False) -> tuple[list[list[int]], int]:
    """Every prompt plus ``max_new_tokens`` fits the model's context; else one error before any sampling.

    Past its context a model with learned positions fails (index out of range) and a RoPE model
    runs silently on positions it never saw: both are refused, unless ``truncate`` (then a prompt
    keeps its last tokens, the ones next to the response). Returns the prompts' token ids and how
    many were cut.
    """
    limit = context_length(model)
    if limit is None:
        return rendered, 0
    over = [(len(ids), r) for r, ids in zip(records, rendered) if len(ids) + max_new_tokens > limit]
    if not over:
        return rendered, 0
    keep = limit - max_new_tokens
    n, worst = max(over, key=lambda x: x[0])
    if truncate and keep >= 1:
        return [ids[-keep:] if len(ids) > keep else ids for ids in rendered], len(over)
    if truncate:
        raise FisherSelectError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context of {limit} "
            f"positions; lower --max-new-tokens below {limit}")
    raise FisherSelectError(
        f"{len(over)} of {len(records)} prompts do not fit the model's context of {limit} positions with "
        f"max_new_tokens={max_new_tokens}: the longest, {worst.describe()}, has {n} tokens; shorten or remove "
        f"those prompts, lower --max-new-tokens to {max(0, limit - n)} or less, or pass --truncate-prompts "
        f"to keep each prompt's last {max(0, keep)} tokens")


def normalized_text(record: PromptRecord) -> str:
    """The text two prompts are compared on: every message's role and content (or the prompt), in lower
    case with runs of whitespace as one space, so a copy that differs only in spacing or case is the same."""
    if record.prompt is not None:
        text = record.prompt
    else:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in record.messages)
    return " ".join(text.lower().split())


def check_disjoint(splits: dict[str, list[PromptRecord]]) -> None:
    """Refuse splits (name -> prompts) that share a prompt's content, in one error naming every shared row.

    Training, validation and held-out prompts must be distinct problems, not only distinct rows: a
    repeated prompt in the file would put a training problem into an evaluation split.
    """
    owner: dict[str, tuple[str, PromptRecord]] = {}
    clashes = []
    for split, records in splits.items():
        for r in records:
            key = normalized_text(r)
            if key in owner and owner[key][0] != split:
                clashes.append(f"{split} {r.describe()} repeats {owner[key][0]} {owner[key][1].describe()}")
            owner.setdefault(key, (split, r))
    if clashes:
        shown = "; ".join(clashes[:8]) + (f"; and {len(clashes) - 8} more" if len(clashes) > 8 else "")
        raise FisherSelectError(f"{len(clashes)} prompt(s) appear in more than one of {', '.join(splits)} "
                                f"(same text after folding case and spacing): {shown}; remove the repeats from the "
                                "prompt file so that no evaluation prompt was trained on")
