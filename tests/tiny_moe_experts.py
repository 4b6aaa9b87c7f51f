"""The tiny MoE models of ``tests/tiny_moe.py`` as the per-expert output tests use them (fp32, eager experts)."""

from __future__ import annotations

import torch

from tests.tiny_moe import FAMILIES
from tests.tiny_moe import tiny_moe as _tiny_moe

EXPERTS = 4  # routed experts per layer
TOP_K = 2
MOE_FAMILIES = FAMILIES


def tiny_moe(family: str, seed: int = 0):
    """A tiny fp32 MoE model of ``family`` in eval mode (4 experts, top-2)."""
    return _tiny_moe(family, experts=EXPERTS, top_k=TOP_K, seed=seed, dtype=torch.float32)
