"""Protocol v2 of the outcome study: replicates with their own draws, lr grids per arm and budget, what a cell is.

Each replicate r has its own calibration seed (``seed + r``), training seed and random disjoint
draw of training, validation and held-out prompts from the prompt file (checked disjoint on
normalized text). On the pilot replicate (r = 0) each arm's lr is chosen on validation from a grid
of at least 4 points spaced by sqrt(10), extended while the choice sits on an edge, up to
``grid_cap`` points; every replicate then trains at that lr and is evaluated on its held-out prompts
only there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass, field

from fisher_select.calibration.prompts import PromptRecord, check_disjoint, normalized_text
from fisher_select.errors import FisherSelectError
from fisher_select.studies.arms import ARMS, BUDGETED_ARMS, CORE_ARMS
from fisher_select.studies.grid import lr_grid

PROTOCOL_VERSION = 2
CORE_BUDGETS = {"sft": (1e-5, 1e-4, 1e-3, 1e-2), "rl": (1e-4, 1e-3), "opd-pg": (1e-4, 1e-3),
                "opd-full": (1e-4, 1e-3)}
# settings that say how much of the study runs, not what a cell does: not part of a cell's hash
STUDY_EXTENT = ("arms", "budgets", "replicates", "grid_points", "grid_cap", "bootstrap")
# sampled response length: on-policy kinds need >= 90% of responses to finish (measured on the embedded default
# with the chat prompts: 94% end within 48 tokens, 79% within 16); SFT samples only for its calibration
MAX_NEW_TOKENS = {"sft": 16, "rl": 48, "opd-pg": 48, "opd-full": 48}
SMALL_BUDGET = 1e-4  # masks at or below it start on a grid that reaches 1.0 (a few coordinates need a large lr)


@dataclass
class ProtocolV2:
    """Everything that defines the study's cells besides the model and the data draw."""

    kind: str
    replicates: int = 6
    seed: int = 0  # replicate r: calibration, draw and training seed seed + r
    train_prompts: int = 48
    validation_prompts: int = 16
    heldout_prompts: int = 32
    budgets: tuple[float, ...] = ()  # () : CORE_BUDGETS[kind]
    arms: tuple[str, ...] = CORE_ARMS  # ARMS holds every known arm (magnitude, lora_config: --arms)
    grid_points: int = 4
    grid_cap: int = 10  # points in a grid after extension, at most
    steps: int = 8
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int | None = None  # None: MAX_NEW_TOKENS[kind]
    batch_size: int = 8
    bootstrap: int = 10_000
    extra: dict = field(default_factory=dict)  # anything else a caller wants in the cells' hash

    def __post_init__(self):
        if not self.budgets:
            self.budgets = CORE_BUDGETS.get(self.kind, ())
        if self.max_new_tokens is None:
            self.max_new_tokens = MAX_NEW_TOKENS.get(self.kind, 48)

    def problems(self) -> list[str]:
        out = []
        if self.replicates < 2:
            out.append(f"replicates must be at least 2 for paired statistics, got {self.replicates}")
        if self.grid_points < 4 or self.grid_cap < self.grid_points:
            out.append(f"grid_points must be at least 4 and grid_cap at least grid_points (got {self.grid_points}, "
                       f"{self.grid_cap})")
        out += [f"budget {b} is not in (0, 1)" for b in self.budgets if not 0 < b < 1]
        unknown = sorted(set(self.arms) - set(ARMS))
        if unknown:
            out.append(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
        if "full" not in self.arms:
            out.append("the arms must include full (the reference every share is taken of)")
        for name in ("train_prompts", "validation_prompts", "heldout_prompts", "steps"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, got {getattr(self, name)}")
        return out

    def as_dict(self) -> dict:
        return {"protocol": PROTOCOL_VERSION, **dataclasses.asdict(self), "budgets": list(self.budgets)}

    def cell_settings(self) -> dict:
        """What defines every cell besides its key: the settings that change what one training run and its
        evaluation do. The study's extent is left out (which arms, budgets and replicates run; the grids'
        starting size and cap; the bootstrap's size): a cell's own arm, budget, replicate and lr are in its
        key, so adding an arm (e.g. ``magnitude``), a budget or a replicate later keeps every finished cell."""
        return {k: v for k, v in self.as_dict().items() if k not in STUDY_EXTENT}

    def cells(self) -> list[tuple[str, float | None]]:
        """(arm, budget) pairs: mask arms and lora_config at every budget, the others once at their own count."""
        return [(a, b) for a in self.arms if a in BUDGETED_ARMS for b in self.budgets] + [
            (a, None) for a in self.arms if a not in BUDGETED_ARMS]

    def minimum_cells(self) -> dict:
        """Cells the study needs when no grid is extended: pilot (every starting grid point on replicate 0)
        and held-out (every arm and the untrained model on every replicate)."""
        pilot = sum(len(self.start_grid(a, b)) for a, b in self.cells())
        held = self.replicates * (len(self.cells()) + 1)
        return {"pilot": pilot, "held_out": held, "total": pilot + held, "calibrations": self.replicates}

    def start_grid(self, arm: str, budget: float | None) -> list[float]:
        """The grid a pilot starts from (extended later while its choice is on an edge)."""
        if arm == "full":
            return lr_grid(1e-6, self.grid_points)
        if budget is None:  # LoRA at its own count
            return lr_grid(1e-4, self.grid_points)
        if budget <= SMALL_BUDGET:  # a few coordinates (masks, or lora_config at that count) need a large lr
            return lr_grid(1e-3, max(self.grid_points, 7))  # 1e-3 .. 1.0
        return lr_grid(1e-4, max(self.grid_points, 5))  # 1e-4 .. 1e-2


def draw(records: list[PromptRecord], protocol: ProtocolV2, replicate: int) -> dict[str, list[PromptRecord]]:
    """The replicate's random disjoint draw of training, validation and held-out prompts."""
    need = protocol.train_prompts + protocol.validation_prompts + protocol.heldout_prompts
    if len(records) < need:
        raise FisherSelectError(f"protocol v2 draws {need} prompts per replicate ({protocol.train_prompts} training, "
                                f"{protocol.validation_prompts} validation, {protocol.heldout_prompts} held-out) but "
                                f"the prompt file has {len(records)}; lower the split sizes")
    order = list(range(len(records)))
    random.Random(f"protocol-v2 draw {protocol.seed + replicate}").shuffle(order)
    a, b = protocol.train_prompts, protocol.train_prompts + protocol.validation_prompts
    splits = {"training": [records[i] for i in order[:a]], "validation": [records[i] for i in order[a:b]],
              "held-out": [records[i] for i in order[b:need]]}
    check_disjoint(splits)
    return splits


def draw_identity(splits: dict[str, list[PromptRecord]]) -> dict[str, dict]:
    """What the cells' hash records of a draw: each split's prompt indices in the file and a digest of
    their normalized texts (an edited prompt file changes it)."""
    return {name: {"indices": [r.index for r in records],
                   "text_sha256": hashlib.sha256("\n".join(normalized_text(r) for r in records).encode()).hexdigest()}
            for name, records in splits.items()}
