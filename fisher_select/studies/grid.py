"""Learning-rate grids of the outcome study: points spaced by sqrt(10), extended while the choice sits on an edge."""

from __future__ import annotations

import math
from dataclasses import dataclass

STEP = math.sqrt(10.0)  # two grid points per decade


def lr_grid(start: float, points: int) -> list[float]:
    """``points`` learning rates from ``start`` upward, each sqrt(10) times the one before."""
    return [start * STEP**i for i in range(points)]


@dataclass
class GridChoice:
    """The grid as finally swept, its validation scores, the chosen lr, and whether it is still on an edge."""

    grid: list[float]
    scores: list[float]
    chosen: float
    on_edge: bool  # the chosen lr is the smallest or the largest of the final grid: a bound, not an optimum
    extended: int  # points added beyond the starting grid

    def as_dict(self) -> dict:
        return {"grid": self.grid, "validation": self.scores, "chosen": self.chosen, "on_edge": self.on_edge,
                "extended": self.extended}

    @classmethod
    def from_dict(cls, d: dict) -> "GridChoice":
        return cls(d["grid"], d["validation"], d["chosen"], d["on_edge"], d["extended"])


def best(grid: list[float], scores: list[float], higher_is_better: bool) -> int:
    """Index of the best score (ties: the smaller lr)."""
    sign = 1.0 if higher_is_better else -1.0
    return max(range(len(grid)), key=lambda i: (sign * scores[i], -grid[i]))


def pick(grid: list[float], scores: list[float], higher_is_better: bool) -> tuple[int, bool]:
    """The best point of a sorted grid (a NaN score, a diverged run, never wins; ties: the smaller lr) and
    whether it is the smallest or the largest point: the one rule the pilot and ``--assemble`` share."""
    clean = [(-math.inf if higher_is_better else math.inf) if math.isnan(s) else s for s in scores]
    i = best(grid, clean, higher_is_better)
    return i, i in (0, len(grid) - 1)


def choose_lr(evaluate, grid: list[float], higher_is_better: bool, cap: int) -> GridChoice:
    """Sweep ``grid`` with ``evaluate(lr) -> validation outcome``; while the best lr is the smallest or
    the largest point, add one point beyond it (x or / sqrt(10)), up to ``cap`` points in all.

    A NaN score (a diverged run) never wins. ``evaluate`` may return None (the time budget ran out):
    the choice is then None.
    """
    grid = sorted(grid)
    scores = [evaluate(lr) for lr in grid]
    start = len(grid)
    while True:
        if any(s is None for s in scores):
            return None
        i, edge = pick(grid, scores, higher_is_better)
        if not edge or len(grid) >= cap:
            return GridChoice(grid, scores, grid[i], edge, len(grid) - start)
        lr = grid[0] / STEP if i == 0 else grid[-1] * STEP
        score = evaluate(lr)
        grid, scores = (([lr] + grid, [score] + scores) if i == 0 else (grid + [lr], scores + [score]))
