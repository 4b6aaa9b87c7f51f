"""The outcome study's record (``outcomes-<kind>.json``), typed and versioned: protocol v2.

``read_outcomes`` reads a record written by ``studies.assemble`` and refuses, with one clear error,
a file of the first protocol (no ``"protocol"`` key): its splits repeated prompts between training
and evaluation and its lr grids stopped at their edges, so none of its numbers can be carried into
a v2 table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fisher_select.errors import FisherSelectError

OUTCOMES_PROTOCOL = 2
FIELDS = ("kind", "settings", "cells", "higher_is_better", "lr_choices", "arms", "trained", "noise_floor",
          "discriminates", "paired", "lr_advice", "verdicts", "training_rows")


@dataclass
class OutcomesRecord:
    """One kind's study: per arm (``name`` or ``name@budget``) the replicates' measures and summaries,
    the lr choices with their edge flags, paired statistics, the trained and discriminating verdicts."""

    kind: str
    settings: dict
    cells: int
    higher_is_better: bool
    lr_choices: dict  # name -> {grid, validation, chosen, on_edge}
    arms: dict  # name -> {lr, lr_on_edge, replicates: {r: measures}, recovered / forgetting / ...: {mean, se, n}}
    trained: dict  # full fine-tuning's improvement over replicates: {mean, se, z, trained}
    noise_floor: dict | None
    discriminates: dict
    paired: dict  # "recovered" / "forgetting" -> "bound@b vs peer" -> {mean_difference, interval, t_p, wilcoxon_p}
    lr_advice: dict
    verdicts: dict  # budget -> {best_peer, verdict: wins / ties / loses, mean_difference, interval, n}
    training_rows: dict  # {signal_share, finished_share, finished_share_first_step} over full fine-tuning's training batches
    protocol: int = OUTCOMES_PROTOCOL
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept when read

    def on_edge(self) -> list[str]:
        """Arms whose chosen lr is still on an edge of its grid (every table flags them)."""
        return sorted(name for name, c in self.lr_choices.items() if c.get("on_edge"))

    def as_dict(self) -> dict:
        data = asdict(self)
        extra = data.pop("extra")
        return {"protocol": data.pop("protocol"), **data, **extra}


def read_outcomes(source) -> OutcomesRecord:
    """An ``OutcomesRecord`` from a dict or a JSON file; one error for an older or unknown protocol."""
    where = "the outcomes record"
    if isinstance(source, (str, Path)):
        where = str(source)
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise FisherSelectError(f"cannot read {where}: {err}; give an outcomes JSON written by "
                                    "bench/outcomes.py --assemble") from None
    version = source.get("protocol") if isinstance(source, dict) else None
    if version is None:
        raise FisherSelectError(f"{where} is an outcome study of protocol 1 (no \"protocol\" key): its splits shared "
                                "prompts between training and evaluation and its lr grids stopped at their edges, so "
                                "it cannot be read as protocol 2; rebuild it with bench/outcomes.py (docs/OUTCOMES.md)")
    if version != OUTCOMES_PROTOCOL:
        raise FisherSelectError(f"{where} has protocol {version!r}; this version reads protocol {OUTCOMES_PROTOCOL} "
                                "only: upgrade fisher_select or rebuild the record")
    missing = [k for k in FIELDS if k not in source]
    if missing:
        raise FisherSelectError(f"{where} (protocol 2) lacks {', '.join(missing)}; rebuild it with "
                                "bench/outcomes.py --assemble")
    extra = {k: v for k, v in source.items() if k not in FIELDS and k != "protocol"}
    return OutcomesRecord(**{k: source[k] for k in FIELDS}, extra=extra)
