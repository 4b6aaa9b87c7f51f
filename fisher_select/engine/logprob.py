"""Response log-probabilities in fp32, with positions counted from each row's first real token."""

from __future__ import annotations

import inspect

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): 0 at a row's first real token, as generation counts positions.

    Left padding would otherwise shift learned positions (GPT-2) and change the scores.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision logits (never bf16 log-softmax); float64 stays float64 (exactness tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int | None = None) -> torch.Tensor:
    """Logits (B, keep, V) of the last ``keep`` positions (all when None), explicit positions, no cache.

    Rows are left padded, so every response sits at the right end: only the last positions'
    logits are needed, and the output head (a fifth of a small model's compute) runs on those.
    """
    kwargs = {}
    if keep is not None and "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )
    logits = out.logits
    return logits if keep is None else logits[:, -keep:]


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B,): summed (never averaged) fp32 log-probability of each row's response tokens.

    ``token_weights`` (B, T), if given, weights each token's log-probability (used for the
    Rademacher-signed token-level Fisher and token-level distillation signals).
    """
    columns = response_mask.any(0).nonzero()
    if len(columns) == 0:  # no response token: every log-probability sum is 0
        return (forward_logits(model, input_ids, attention_mask, 1).sum() * 0).expand(input_ids.shape[0])
    start = int(columns[0]) - 1  # the first logits column any response token needs
    logits = forward_logits(model, input_ids, attention_mask, input_ids.shape[1] - start)  # (B, T-start, V)
    logp = torch.log_softmax(logits[:, :-1].to(_at_least_fp32(logits)), dim=-1)  # fp32 at least
    here = logits.device  # the output head's device, when a model spans several
    per_token = logp.gather(-1, input_ids[:, start + 1 :, None].to(here)).squeeze(-1)  # (B, T-start-1)
    weights = response_mask[:, start + 1 :].to(here).to(logp.dtype)
    if token_weights is not None:
        weights = weights * token_weights[:, start + 1 :].to(here).to(logp.dtype)
    return (per_token * weights).sum(-1)
