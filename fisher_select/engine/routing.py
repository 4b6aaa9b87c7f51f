"""Where tokens meet experts: per-expert token counts of MoE layers, and the refusal of flattened rows.

MoE layers see the batch flattened to (B*T, d) token rows. Their rules (``rules/moe.py``) say
so (``Rule.flat_tokens``) and report the routing of each call (``Rule.routing``); every other rule
takes dim 0 for the sample, so a module it covers that is called on other than B rows (transformers
4.x kept MoE experts and routers as ``nn.Linear`` on flattened tokens) is refused, never scored.
"""

from __future__ import annotations

import torch
from torch import nn

from fisher_select.errors import FisherSelectError


def not_per_sample(module: nn.Module, rows: int, batch: int) -> FisherSelectError:
    """A rule that takes dim 0 for the sample met a module called on other rows (tokens flattened)."""
    return FisherSelectError(
        f"{type(module).__name__} ({type(module).__module__}) was called on {rows} rows for a batch of {batch} "
        "samples: its input is not (samples, ...), so its rule would mix samples (transformers 4.x MoE experts and "
        "routers are nn.Linear on flattened tokens). Use transformers >= 5 for MoE models, or leave this module's "
        "parameters out with params="
    )


def count_routes(model: nn.Module, calls: list, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                 out) -> None:
    """Add this batch's tokens per expert of every routed call to ``out``'s counts (a ``ScoreSums``).

    ``calls``: the pass's (module, info, captured) forward calls; a rule's ``routing`` answers for
    MoE experts. Counted per choice (top-k: a token counts once for each expert it went to).
    """
    routed = [(m, i.rule.routing(m, c)) for m, i, c in calls]
    routed = [(m, r) for m, r in routed if r is not None]
    if not routed:
        return
    names = {id(m): n for n, m in model.named_modules()}
    for module, (index, experts) in routed:
        index = index.reshape(*attention_mask.shape, -1)  # (B, T, k)
        for counts, mask in ((out.expert_tokens, response_mask), (out.expert_positions, attention_mask)):
            chosen = index[mask.to(index.device).bool()].flatten()  # expert ids of the masked positions' choices
            chosen = chosen[(chosen >= 0) & (chosen < experts)]  # an expert-parallel sentinel is no expert
            add = torch.bincount(chosen, minlength=experts).cpu()  # (E,)
            name = names[id(module)]
            counts[name] = counts[name] + add if name in counts else add
