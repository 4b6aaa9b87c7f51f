"""Wall time per phase of a run (report.json's ``timings``): where a calibration's time goes."""

from __future__ import annotations

import time


class PhaseClock:
    """Laps of one wall clock: each ``lap(name)`` charges the time since the previous lap to ``name``,
    so the phases add up to the wall time by construction; ``split`` divides a lap into parts
    measured inside it (sampling and scoring inside the calibration)."""

    def __init__(self) -> None:
        self.start = self.mark = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.mark
        self.mark = now

    def split(self, name: str, parts: dict[str, float], rest: str) -> None:
        """Replace lap ``name`` by ``parts`` (seconds measured inside it) and ``rest``, what is left; the
        phases still add up to the wall time."""
        whole = self.phases.get(name, 0.0)
        scale = min(1.0, whole / max(sum(parts.values()), 1e-12))  # parts can only fill their own lap
        inside = {k: v * scale for k, v in parts.items()}
        inside[rest] = max(0.0, whole - sum(inside.values()))
        ordered = {}  # the parts take the lap's place in the order of phases
        for key, seconds in self.phases.items():
            ordered.update(inside if key == name else {key: seconds})
        self.phases = ordered

    def to_json(self, rates: dict[str, float] | None = None) -> dict:
        """Seconds per phase, the wall time they add up to, each phase's share, and ``rates``."""
        wall = self.mark - self.start
        return {"phases_s": {k: round(v, 4) for k, v in self.phases.items()}, "wall_s": round(wall, 4),
                "shares": {k: round(v / wall, 4) if wall > 0 else None for k, v in self.phases.items()},
                **(rates or {})}
