"""A histogram as the report stores it: counts per bin, edges one longer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Histogram:
    """Counts per bin: ``edges`` has one more entry than ``counts``."""

    edges: list[float]
    counts: list[float]
