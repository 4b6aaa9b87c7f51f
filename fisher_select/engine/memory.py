"""Memory modes: which parameter-sized fp32 accumulators a calibration keeps, for which
parameters, and where they live.

Every accumulator is parameter-sized, so for a large model they, not the activations, decide
what fits beside the weights (fp32: 4 bytes per parameter coordinate each):

- ``full``: squares (F), one signal sum per objective (g), score sums (the score-mean check and
  the autograd check of the first batch): ``4 * (2 + O)`` bytes per parameter.
- ``gradient``: squares and signal sums, no score sums: ``4 * (1 + O)``; no score-mean check,
  no autograd check of the score sums (the rules' self-check, ``engine.selfcheck``, still runs).
- ``fisher``: squares only, ``4`` bytes per parameter: F and the bounds (which need only F and
  S), no gradient estimate g, no checks that need score sums.

``modules`` (a regular expression searched in each ``named_parameters()`` name) keeps
accumulators for the matching parameters only; the other layers are not hooked at all.
``accumulate_on="cpu"`` keeps the accumulators in host memory (pinned when CUDA is present):
each piece is reduced over its samples on the device, then copied and added.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fisher_select.engine.scoring import Coverage, ScoreSums, _restricted
from fisher_select.errors import FisherSelectError

ACCUMULATORS = ("full", "gradient", "fisher")
ACCUMULATE_ON = ("device", "cpu")


@dataclass(frozen=True)
class MemoryMode:
    """What ``calibrate`` accumulates; the default keeps everything on the parameters' devices."""

    accumulators: str = "full"
    modules: str | None = None  # regex over parameter names; None: every parameter
    accumulate_on: str = "device"

    def __post_init__(self):
        problems = []
        if self.accumulators not in ACCUMULATORS:
            problems.append(f"accumulators must be one of {', '.join(ACCUMULATORS)}, got {self.accumulators!r}")
        if self.accumulate_on not in ACCUMULATE_ON:
            problems.append(f"accumulate_on must be one of {', '.join(ACCUMULATE_ON)}, got {self.accumulate_on!r}")
        if self.modules is not None:
            try:
                re.compile(self.modules)
            except re.error as err:
                problems.append(f"modules is not a regular expression ({err}): {self.modules!r}")
        if problems:
            raise FisherSelectError("; ".join(problems))

    @property
    def totals(self) -> bool:
        return self.accumulators == "full"

    @property
    def signals(self) -> bool:
        return self.accumulators != "fisher"

    @property
    def device(self) -> str | None:
        return "cpu" if self.accumulate_on == "cpu" else None

    def restrict(self, cov: Coverage) -> Coverage:
        """``cov`` restricted to the parameters ``modules`` matches (all of them without it)."""
        if self.modules is None:
            return cov
        pattern = re.compile(self.modules)
        chosen = {n for n in cov.shapes if pattern.search(n)}
        if not chosen:
            raise FisherSelectError(f"modules={self.modules!r} matches no parameter name "
                                    f"(names look like {next(iter(cov.shapes), '?')!r})")
        return _restricted(cov, chosen)

    def signal(self, signal):
        """The signal a scoring pass gets: none when no signal sums are kept."""
        return signal if self.signals else None

    def score_kwargs(self) -> dict:
        """Keyword arguments of ``score_sums`` for a pass that creates the sums."""
        return {"squares": True, "totals": self.totals, "accumulate_on": self.device}

    def zeros(self, cov: Coverage, objectives: int) -> ScoreSums:
        """Empty sums in this mode for ``objectives`` signal rows (ignored without signal sums)."""
        return ScoreSums.zeros(cov, objectives if self.signals else None, totals=self.totals, device=self.device)

    def missing(self, cov: Coverage, all_params: int) -> list[str]:
        """What a run in this mode lacks, one sentence each (report warnings)."""
        out = []
        if not self.totals:
            out.append(f"accumulators={self.accumulators}: no score sums were kept, so the score-mean check "
                       "and the autograd check of the first batch's score sums did not run (the rules' "
                       "self-check did: checks.selfcheck); run once with accumulators=full (e.g. on fewer "
                       "prompts) to check the sampling and the engine on this model")
        if not self.signals:
            out.append("accumulators=fisher: no signal sums were kept, so no gradient estimate g was written "
                       "(its grad_estimate files are empty) and no bound-to-gradient ratios were computed; "
                       "F, S and the bounds are complete")
        if self.modules is not None:
            out.append(f"modules={self.modules!r}: F covers {len(cov.shapes)} of {all_params} parameters; "
                       "the others have no Fisher, bounds or masks in this run")
        return out

    def describe(self) -> dict:
        return {"accumulators": self.accumulators, "modules": self.modules, "accumulate_on": self.accumulate_on}
