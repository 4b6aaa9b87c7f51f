"""Response log-probabilities in fp32, with positions counted from each row's first real token."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): 0 at a row's first real token, as generation counts positions.

    Left padding would otherwise shift learned positions (GPT-2) and change the scores.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V), (B, T) -> (B, T): ``log pi(ids[:, t] | ids[:, :t])`` for t >= 1; 0 at t = 0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # fp32 always
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return F.pad(picked, (1, 0))


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits (B, T, V) with explicit position ids and no cache."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.logits


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
    per_token = token_logprobs(forward_logits(model, input_ids, attention_mask), input_ids)
    weights = response_mask.float()
    if token_weights is not None:
        weights = weights * token_weights.float()
    return (per_token * weights).sum(-1)
