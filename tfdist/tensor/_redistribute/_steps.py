"""What a redistribute plan is made of: torch-level steps and the physical operations that run them.

A :class:`Plan` is data.  ``steps`` are torch's view (one collective on one
mesh dim, with the bytes each device sends); ``ops`` are what the executor
(``_execute``) applies, in order, to the physical TF DTensor: each names a
local reshaping or one TF relayout, with the sharding specs (TF's per-dim
mesh dim names, stacked Partial axes first) it leaves the tensor in.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np
from tensorflow.experimental import dtensor

from tfdist.tensor.placement_types import Placement

__all__ = ["TransformStep", "Relayout", "Resize", "Move", "Gather", "Reduce", "Merge", "Split", "GatherPieces",
           "Op", "Plan"]

Specs = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TransformStep:
    """One step of a redistribute: a mesh dim's collective and the bytes each device sends."""

    mesh_dim: str
    src: Placement
    dst: Placement
    collective: str  # all_gather, all_to_all, all_reduce, reduce_scatter, none
    bytes_per_device: float = 0.0

    def __str__(self) -> str:
        return f"{self.mesh_dim}: {self.src} -> {self.dst} ({self.collective})"


@dataclasses.dataclass(frozen=True)
class Relayout:
    """One TF relayout to ``specs`` (a local slice when it only shards; a pin when it changes nothing)."""

    specs: Specs


@dataclasses.dataclass(frozen=True)
class Resize:
    """Pads (zeros) or slices physical ``axis`` at its end to ``size``; the axis is whole on every device,
    so this is local.  The result is pinned to ``specs``: inside tf.function TF DTensor would otherwise
    pull the next relayout's sharding back into the pad, which its SPMD expander rejects."""

    axis: int
    size: int
    specs: Specs


@dataclasses.dataclass(frozen=True)
class Move:
    """The all-to-all moving the mesh dim of physical dim ``src`` onto dim ``dst`` (``specs`` before);
    ``reduce_scatter`` marks it as the collective of a reduce-scatter for CommDebugMode."""

    src: int
    dst: int
    specs: Specs
    reduce_scatter: bool = False


@dataclasses.dataclass(frozen=True)
class Gather:
    """The all-gather unsharding physical dim ``axis`` (``specs`` before)."""

    axis: int
    specs: Specs


@dataclasses.dataclass(frozen=True)
class Reduce:
    """Local reduce (``op``: sum, avg, ...) of the stacked Partial ``axes``; sharded axes make TF all-reduce."""

    op: str
    axes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Merge:
    """Local reshape: ``count`` physical dims from ``first`` become one, then laid out ``specs``."""

    first: int
    count: int
    specs: Specs


@dataclasses.dataclass(frozen=True)
class Split:
    """Local reshape: physical dim ``axis`` becomes ``parts`` (one entry may be -1), laid out ``specs``."""

    axis: int
    parts: tuple[int, ...]
    specs: Specs


@dataclasses.dataclass(frozen=True, eq=False)
class GatherPieces:
    """Per outer piece (physical ``axis``), a local gather of rows ``index[piece]`` along ``axis + 1``,
    where row ``rows`` (one past the end) reads zeros (a pad slot)."""

    axis: int
    index: np.ndarray
    specs: Specs


Op = Union[Relayout, Resize, Move, Gather, Reduce, Merge, Split, GatherPieces]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A redistribute, decided: torch's steps (with bytes) and the ops that run them on ``mesh``."""

    mesh: dtensor.Mesh
    steps: tuple[TransformStep, ...]
    ops: tuple[Op, ...]

    @property
    def bytes_per_device(self) -> float:
        return sum(s.bytes_per_device for s in self.steps)
