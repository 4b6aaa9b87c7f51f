"""Token-level scoring for token-level objectives (full-vocabulary distillation): F^tok and their gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fisher_select.distributed import all_reduce_int, all_reduce_sums
from fisher_select.engine.batching import score_in_budget
from fisher_select.engine.scoring import Coverage, ScoreSums


@dataclass
class TokenState:
    """What a checkpoint keeps of ``TokenLevel``: the sign generator and its sums."""

    signs: torch.Tensor  # the sign generator's state
    squares: ScoreSums | None
    grads: list[ScoreSums | None]


class TokenLevel:
    """Token-level Fisher and gradients for token-level objectives (full-vocabulary distillation).

    ``F^tok_i = E_y sum_t h_{t,i}^2`` from Rademacher signs: backprop of ``sum_t eps_t log pi(y_t|s_t)``
    has ``E_eps[(d_i u)^2] = sum_t h_{t,i}^2``, so the per-sample squares of one signed backward
    estimate it at the cost of the sequence Fisher (``sign_draws`` backwards reduce the noise).
    The gradient estimate ``mean_n sum_t A_t h_{n,t}`` is the plain score sum of one backward
    with token weights ``A_t``. Gradients are kept per token-level objective, by position.
    """

    def __init__(self, model, coverage: Coverage, device, seed: int, draws: int, objectives: int,
                 engine: dict | None = None):
        self.model, self.cov, self.device, self.draws = model, coverage, device, draws
        self.engine = engine or {"max_tokens": None}  # micro-batches; the signs are drawn for the whole batch first
        self.signs = torch.Generator(device=device).manual_seed(seed)
        self.squares: ScoreSums | None = None
        self.grads: list[ScoreSums | None] = [None] * objectives

    def add(self, input_ids, attention_mask, response_mask, token_signals: list[list[torch.Tensor]]) -> None:
        """input_ids, attention_mask, response_mask: (B, T); ``token_signals[j][b]``: (L_b,) signal of
        the j-th token-level objective at row b's response tokens."""
        args = (self.model, input_ids, attention_mask, response_mask)
        for _ in range(self.draws):
            eps = torch.randint(0, 2, input_ids.shape, generator=self.signs, device=self.device) * 2.0 - 1
            self.squares = score_in_budget(*args, token_weights=eps, coverage=self.cov, into=self.squares,
                                           **self.engine)
        for j, rows in enumerate(token_signals):
            weights = torch.zeros(input_ids.shape, dtype=torch.float32, device=self.device)  # (B, T)
            for b, a in enumerate(rows):
                weights[b, response_mask[b]] = a.to(weights)
            self.grads[j] = score_in_budget(*args, token_weights=weights, coverage=self.cov, into=self.grads[j],
                                            squares=False, **self.engine)

    def merge_ranks(self) -> None:
        if self.squares is None:
            self.squares = ScoreSums.zeros(self.cov, None)
        self.squares.count = all_reduce_int(self.squares.count, self.device)
        all_reduce_sums(self.squares.squares)
        for j, sums in enumerate(self.grads):
            if sums is None:
                sums = self.grads[j] = ScoreSums.zeros(self.cov, None, squares=False)
            sums.count = all_reduce_int(sums.count, self.device)
            all_reduce_sums(sums.total)

    def fisher(self) -> dict[str, torch.Tensor]:
        n = self.squares.count  # samples x draws
        return {name: sq / n for name, sq in self.squares.squares.items()}

    def grad_estimate(self, j: int) -> dict[str, torch.Tensor]:
        """Mean over samples of sum_t A_t h_t for the j-th token-level objective."""
        sums = self.grads[j]
        return {k: t / sums.count for k, t in sums.total.items()}

    def state(self) -> TokenState:
        return TokenState(self.signs.get_state(), self.squares, list(self.grads))

    def restore(self, state: TokenState) -> None:
        self.signs.set_state(state.signs)
        self.squares, self.grads = state.squares, list(state.grads)
