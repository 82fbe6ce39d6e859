"""The actions of a schedule and torch's string form of them (``"0F0"``, ``"1B3"``, ``"2I1"``, ``"0REDUCE_GRAD"``)."""

from __future__ import annotations

import enum
import re
from typing import NamedTuple


class ComputationType(enum.Enum):
    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    REDUCE_GRAD = "REDUCE_GRAD"
    OVERLAP_F_B = "OVERLAP_F_B"


F, B, I, W, REDUCE_GRAD, OVERLAP_F_B = (
    ComputationType.FORWARD, ComputationType.FULL_BACKWARD, ComputationType.BACKWARD_INPUT,
    ComputationType.BACKWARD_WEIGHT, ComputationType.REDUCE_GRAD, ComputationType.OVERLAP_F_B)
_PATTERN = re.compile(r"^(\d+)(F|B|I|W|REDUCE_GRAD)(\d*)$")


class Action(NamedTuple):
    """Stage ``stage_index`` does ``computation_type`` on microbatch ``microbatch_index``; an
    ``OVERLAP_F_B`` action holds a forward and a backward (``sub_actions``) run back to back."""

    stage_index: int
    computation_type: ComputationType
    microbatch_index: int | None = None
    sub_actions: tuple | None = None

    def __str__(self) -> str:
        if self.sub_actions is not None:
            return "(" + ";".join(str(a) for a in self.sub_actions) + f"){self.computation_type.value}"
        mb = "" if self.microbatch_index is None else str(self.microbatch_index)
        return f"{self.stage_index}{self.computation_type.value}{mb}"

    __repr__ = __str__

    @staticmethod
    def from_str(text: str) -> Action:
        m = _PATTERN.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. '0F0', '1B3', '2W1', '0REDUCE_GRAD')")
        return Action(int(m.group(1)), ComputationType(m.group(2)), int(m.group(3)) if m.group(3) else None)


def format_pipeline_order(order: dict[int, list[Action | None]]) -> str:
    """A text table: one column per rank, one row per time step (torch's layout)."""
    steps = max((len(a) for a in order.values()), default=0)
    ranks = sorted(order)
    cells = [[str(order[r][t]) if t < len(order[r]) and order[r][t] is not None else "" for r in ranks]
             for t in range(steps)]
    width = max([len(f"Rank {r}") for r in ranks] + [len(c) for row in cells for c in row] + [1])
    lines = ["Step  " + " ".join(f"Rank {r}".ljust(width) for r in ranks)]
    lines += [f"{t:<5} " + " ".join(c.ljust(width) for c in row) for t, row in enumerate(cells)]
    return "\n".join(lines)
