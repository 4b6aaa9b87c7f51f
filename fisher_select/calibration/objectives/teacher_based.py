"""Objectives that need a second density over responses: a teacher (distillation) or a demonstrator (SFT)."""

from __future__ import annotations

from fisher_select.calibration.objectives.base import Context, Objective
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

    def describe(self) -> dict:
        return {**super().describe(), self.role: describe_teacher(self.spec)}
