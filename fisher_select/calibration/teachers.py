"""Teachers and demonstrators: a second density over the model's own responses.

SFT toward a demonstrator nu and on-policy distillation from a teacher T need, for responses y
sampled from the model, ``log nu(y|x)`` (or ``log T(y|x)``) and, for full-vocabulary
distillation, the teacher's whole next-token distribution at every visited state. The teacher
is either

- another causal LM with the **same tokenizer** (checked: a different vocabulary would score
  other strings than the ones the model wrote), or
- the model itself under another context: a system prompt it should internalise (context
  distillation) or a user-message template that adds privileged fields of the prompt record,
  e.g. the reference answer.

Only the context differs between model and teacher; the response tokens are the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.engine.logprob import forward_logits
from fisher_select.models import load_model
from fisher_select.calibration.prompts import PromptRecord, render_prompt
from fisher_select.calibration.sampling import left_pad
from fisher_select.calibration.config import SELF, TeacherConfig


@dataclass
class Teacher:
    """A causal LM (possibly the model itself) and the context it sees for each prompt.

    ``tokenizer`` None means the model's tokenizer (an in-memory model built on the same
    vocabulary). A separate model should be in eval mode; ``resolve_teacher`` puts it there.
    """

    model: object
    tokenizer: object | None = None
    system_prompt: str | None = None
    user_template: str | None = None
    name: str = "teacher"

    @property
    def same_context(self) -> bool:
        return self.system_prompt is None and self.user_template is None

    def context_ids(self, record: PromptRecord, prompt_ids: list[int]) -> list[int]:
        """Token ids of the teacher's prompt for ``record`` (the model's own when nothing changes)."""
        if self.same_context:
            return prompt_ids
        return render_prompt(self.tokenizer, self._record(record))

    def _record(self, record: PromptRecord) -> PromptRecord:
        """The prompt record as the teacher sees it: system prompt and user template applied."""
        if not getattr(self.tokenizer, "chat_template", None):
            if record.messages is not None:
                raise FisherSelectError(f"{record.describe()} has \"messages\" but the tokenizer has no chat template")
            text = self._user_text(record, record.prompt)
            if self.system_prompt is not None:
                text = f"{self.system_prompt}\n\n{text}"  # no template: the context is plain text before it
            return PromptRecord(record.index, text, None, record.fields)
        messages = [dict(m) for m in (record.messages or [{"role": "user", "content": record.prompt}])]
        last_user = _last_user_index(messages)
        messages[last_user]["content"] = self._user_text(record, messages[last_user]["content"])
        if self.system_prompt is not None:
            if messages[0]["role"] == "system":  # the record's own system message stays, the teacher's follows
                messages[0]["content"] = f"{messages[0]['content']}\n\n{self.system_prompt}"
            else:  # replaces a template's default system message, if it has one
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        return PromptRecord(record.index, None, messages, record.fields)

    def _user_text(self, record: PromptRecord, content: str) -> str:
        if self.user_template is None:
            return content
        try:
            return self.user_template.format_map({**record.fields, "prompt": content})
        except KeyError as exc:
            raise FisherSelectError(
                f"{self.name}'s user_template uses {{{exc.args[0]}}} but {record.describe()} has no "
                f"field {exc.args[0]!r}; add it to every prompt line or change the template"
            ) from None

    def sequence_logprobs(self, group) -> torch.Tensor:
        """(K,) float64 ``log T(y_k | teacher context)`` for the group's responses (-inf allowed)."""
        contexts = [self.context_ids(group.record, group.prompt_ids)] * len(group.responses)
        return sequence_logprobs(self.model, contexts, group.responses)

    def token_tables(self, group) -> list[torch.Tensor]:
        """Per response, (L_k, V) fp32 ``log T(. | s_t)`` at the states the response visits."""
        contexts = [self.context_ids(group.record, group.prompt_ids)] * len(group.responses)
        return token_tables(self.model, contexts, group.responses)


def _last_user_index(messages: list[dict]) -> int:
    """The message a user template rewrites: the last user turn (the last message if none is)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-1] if users else len(messages) - 1


def _response_states(model, contexts: list[list[int]], responses: list[list[int]]):
    """(B, M, V) fp32 log-softmax at the last M = max response length states of each row, and the
    (B, M) tokens drawn there.

    Rows are left padded, so every response ends at the right edge: row b's L_b response tokens
    are the last L_b of the M columns. Only those logits are computed (``forward_logits(keep=)``).
    """
    rows = [c + r for c, r in zip(contexts, responses)]
    device = next(model.parameters()).device
    ids, mask = left_pad(rows, 0, device)  # pad id irrelevant: masked, positions from the mask
    longest = max(len(r) for r in responses)
    with torch.no_grad():
        logits = forward_logits(model, ids, mask, longest + 1)  # (B, M+1, V); column j predicts j+1
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, M, V) fp32 always
    return logp, ids[:, -longest:]


@torch.no_grad()
def sequence_logprobs(model, contexts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
    """(B,) float64: summed fp32 log-probabilities of each response after its context.

    Summed in fp64 with ``where`` (not a multiply by a mask), so a -inf token stays -inf and
    padding never turns it into NaN.
    """
    logp, tokens = _response_states(model, contexts, responses)
    picked = logp.gather(-1, tokens[..., None]).squeeze(-1).double()  # (B, M)
    longest = tokens.shape[1]
    column = torch.arange(longest, device=tokens.device)
    lengths = torch.tensor([len(r) for r in responses], device=tokens.device)
    is_response = column[None, :] >= longest - lengths[:, None]  # (B, M)
    return torch.where(is_response, picked, 0.0).sum(-1).cpu()


@torch.no_grad()
def token_tables(model, contexts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
    """Per response, (L_k, V) fp32 log-softmax of the next-token distribution at each response state.

    Row t of a table is the distribution the response's t-th token was drawn from.
    """
    logp, tokens = _response_states(model, contexts, responses)
    longest = tokens.shape[1]
    return [logp[b, longest - len(r) :].cpu() for b, r in enumerate(responses)]


# ---------------------------------------------------------------------------
# Resolving and checking


def resolve_teacher(spec: Teacher | TeacherConfig, ctx, role: str = "teacher") -> Teacher:
    """A ready teacher for the model in ``ctx`` (objectives.Context), its tokenizer checked.

    ``TeacherConfig.model == "self"`` reuses the model being calibrated; another spec is loaded
    offline with ``models.load_model`` on the model's device and dtype.
    """
    if isinstance(spec, TeacherConfig):
        if spec.model == SELF:
            teacher = Teacher(ctx.model, ctx.tokenizer, spec.system_prompt, spec.user_template,
                              name=f"the {role} (the model itself under another context)")
        else:
            model, tokenizer, _ = load_model(spec.model, device=str(ctx.device), dtype=_dtype_name(ctx.model))
            teacher = Teacher(model, tokenizer, spec.system_prompt, spec.user_template, name=f"the {role} {spec.model}")
    elif isinstance(spec, Teacher):
        tokenizer = spec.tokenizer or ctx.tokenizer  # None: built on the model's vocabulary
        teacher = Teacher(spec.model, tokenizer, spec.system_prompt, spec.user_template, spec.name)
    else:
        raise FisherSelectError(f"{role}: expected a Teacher or TeacherConfig, got {type(spec).__name__}")
    if teacher.model is not ctx.model:
        teacher.model.eval()  # dropout would make log T random
        check_same_vocabulary(ctx.tokenizer, teacher.tokenizer, teacher.name)
        check_output_width(ctx.model, teacher.model, teacher.name)
    return teacher


def describe_teacher(spec: Teacher | TeacherConfig) -> dict:
    """Report fields of a teacher spec (an in-memory model is named by its class)."""
    model = spec.model if isinstance(spec, TeacherConfig) else f"{type(spec.model).__name__} (in memory)"
    return {"model": model, "system_prompt": spec.system_prompt, "user_template": spec.user_template}


def _dtype_name(model) -> str:
    dtype = next(model.parameters()).dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def check_same_vocabulary(model_tokenizer, teacher_tokenizer, what: str = "the teacher") -> None:
    """Refuse a teacher whose token strings differ from the model's, naming the first difference."""
    mine = {i: t for t, i in model_tokenizer.get_vocab().items()}
    theirs = {i: t for t, i in teacher_tokenizer.get_vocab().items()}
    if mine == theirs:
        return
    first = min(i for i in mine.keys() | theirs.keys() if mine.get(i) != theirs.get(i))
    if first not in theirs or first not in mine:
        where, token = ("the model's", mine[first]) if first in mine else (f"{what}'s", theirs[first])
        raise FisherSelectError(
            f"{what} has {len(theirs)} tokens, the model {len(mine)}: id {first} ({token!r}) is only in "
            f"{where} vocabulary; a teacher must share the model's tokenizer (same ids, same strings)"
        )
    raise FisherSelectError(
        f"{what}'s tokenizer differs from the model's at id {first}: the model has {mine[first]!r}, "
        f"{what} has {theirs[first]!r}; a teacher must share the model's tokenizer"
    )


def check_output_width(model, teacher_model, what: str = "the teacher") -> None:
    """Same tokenizer but a different number of output logits (padded embeddings): refuse."""
    mine = getattr(getattr(model, "config", None), "vocab_size", None)
    theirs = getattr(getattr(teacher_model, "config", None), "vocab_size", None)
    if mine is not None and theirs is not None and mine != theirs:
        raise FisherSelectError(
            f"{what} outputs {theirs} logits per position, the model {mine}: their distributions "
            "cannot be compared token by token; use a teacher with the same vocabulary size"
        )
