"""Objectives that need a second density over responses: a teacher (distillation) or a demonstrator (SFT)."""

from __future__ import annotations

import torch

from fisher_select.calibration.objectives.base import Context, Group, Objective
from fisher_select.calibration.rollouts import given_values
from fisher_select.calibration.teachers import Teacher, TeacherConfig, describe_teacher, resolve_teacher


class TeacherObjective(Objective):
    """Resolves its ``role`` model before sampling (shared tokenizer checked) and describes it in reports."""

    role = "teacher"

    def __init__(self, teacher: Teacher | TeacherConfig, name: str | None = None):
        super().__init__(name)
        self.spec = teacher
        self.teacher: Teacher | None = None  # resolved from spec by prepare()

    def prepare(self, ctx: Context, prompts) -> None:
        self.teacher = resolve_teacher(self.spec, ctx, role=self.role)

    def _ready(self, ctx: Context) -> Teacher:
        if self.teacher is None:  # used outside calibrate()
            self.prepare(ctx, [])
        return self.teacher

    def sequence_logprobs(self, group: Group, ctx: Context) -> torch.Tensor:
        """(K,) float64 log T(y|x): a rollout file's teacher log-probs when it has them, else the teacher's."""
        given = given_values(group, "teacher_logprob", self.name)
        if given is not None:
            return torch.tensor(given, dtype=torch.float64)
        return self._ready(ctx).sequence_logprobs(group)

    def describe(self) -> dict:
        return {**super().describe(), self.role: describe_teacher(self.spec)}
