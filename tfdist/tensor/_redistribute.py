"""Redistribute: move a physical TF DTensor from one spec to another.

A transition on one mesh dim maps to one collective (torch's table):

===================  ==================  ====================================
from                 to                  what runs
===================  ==================  ====================================
Shard(d)             Replicate()         all-gather
Shard(i)             Shard(j)            all-to-all
Replicate()          Shard(d)            local slice, no communication
Partial(op)          Replicate()         all-reduce
Partial(op)          Shard(d)            reduce-scatter
===================  ==================  ====================================

The whole N-D move is at most one reduction (resolving every Partial mesh
dim at once) plus one ``dtensor.relayout``: TF DTensor picks the per-dim
collectives of the relayout.  Uneven shards are re-padded on dims that are
replicated at that moment, where padding and slicing are local.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor._layout import DTensorSpec, physical_layout
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["TransformStep", "plan_redistribute", "redistribute_physical"]

logger = logging.getLogger("tfdist.redistribute")
if "redistribute" in os.environ.get("TFDIST_LOGS", "").replace(" ", "").split(","):
    logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        logging.basicConfig()

_REDUCERS = {
    "sum": tf.math.reduce_sum,
    "avg": tf.math.reduce_mean,
    "product": tf.math.reduce_prod,
    "max": tf.math.reduce_max,
    "min": tf.math.reduce_min,
}


@dataclasses.dataclass(frozen=True)
class TransformStep:
    """One mesh dim's part of a redistribute plan."""

    mesh_dim: str
    src: Placement
    dst: Placement
    collective: str  # all_gather, all_to_all, all_reduce, reduce_scatter, none

    def __str__(self) -> str:
        return f"{self.mesh_dim}: {self.src} -> {self.dst} ({self.collective})"


def _collective(src: Placement, dst: Placement) -> str:
    if src == dst:
        return "none"
    if isinstance(src, Partial):
        return "reduce_scatter" if isinstance(dst, Shard) else "all_reduce"
    if isinstance(src, Shard):
        return "all_to_all" if isinstance(dst, Shard) else "all_gather"
    return "none"  # Replicate -> Shard is a local slice


def check_transition(src: DTensorSpec, dst: DTensorSpec) -> None:
    """Refuses what torch refuses: creating Partial by redistribute."""
    for m, (a, b) in enumerate(zip(src.root_placements, dst.root_placements)):
        if isinstance(b, Partial) and a != b:
            raise ValueError(
                f"redistributing to {b!r} on mesh dim "
                f"{src.mesh.root_mesh.axis_names[m]!r} is not supported (from {a!r}); "
                "Partial only comes from operators or DTensor.from_local. "
                f"Received: placements={dst.placements!r}"
            )


def plan_redistribute(src: DTensorSpec, dst: DTensorSpec) -> list[TransformStep]:
    """Per mesh dim, the transition and the collective it needs."""
    names = src.mesh.root_mesh.axis_names
    return [
        TransformStep(names[m], a, b, _collective(a, b))
        for m, (a, b) in enumerate(zip(src.root_placements, dst.root_placements))
        if a != b
    ]


def _resolve_partials(
    x: tf.Tensor, spec: DTensorSpec, keep: Sequence[int]
) -> tuple[tf.Tensor, list[Placement]]:
    """Reduces the leading Partial axes whose mesh dim is not in ``keep``."""
    placements = list(spec.root_placements)
    # Group consecutive axes with the same reduce op into one reduction.
    drop_by_op: dict[str, list[int]] = {}
    for axis, m in enumerate(spec.partial_mesh_dims):
        if m not in keep:
            drop_by_op.setdefault(placements[m].reduce_op, []).append(axis)
    if not drop_by_op:
        return x, placements
    removed = 0
    for op, axes in drop_by_op.items():
        x = _REDUCERS[op](x, axis=[a - removed for a in axes])
        removed += len(axes)
    for m in spec.partial_mesh_dims:
        if m not in keep:
            placements[m] = Replicate()
    return x, placements


def _shard_map(placements: Sequence[Placement]) -> dict[int, int]:
    return {p.dim: m for m, p in enumerate(placements) if isinstance(p, Shard)}


def _resize_dims(
    x: tf.Tensor, lead: int, sizes: dict[int, int], layout: dtensor.Layout
) -> tf.Tensor:
    """Pads or slices (at the end) logical dims to ``sizes``; dims must be replicated.

    The result is pinned to ``layout`` (the input's): inside tf.function TF
    DTensor would otherwise pull the *next* relayout's sharding back into
    the pad, which its SPMD expander rejects.
    """
    if not sizes:
        return x
    shape = x.shape.as_list()
    pads = [[0, 0] for _ in shape]
    begin = [0] * len(shape)
    size = list(shape)
    grow = shrink = False
    for d, want in sizes.items():
        have = shape[lead + d]
        if want > have:
            pads[lead + d][1] = want - have
            grow = True
        elif want < have:
            size[lead + d] = want
            shrink = True
    if shrink:
        x = tf.slice(x, begin, size)
    if grow:
        x = tf.pad(x, pads)
    return dtensor.relayout(x, layout)


def redistribute_physical(x: tf.Tensor, src: DTensorSpec, dst: DTensorSpec) -> tf.Tensor:
    """Returns the physical tensor for ``dst`` holding the same global values as ``x``."""
    if src.root_placements == dst.root_placements:
        return x
    check_transition(src, dst)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "redistribute %s: %s",
            src.shape,
            "; ".join(str(s) for s in plan_redistribute(src, dst)) or "no-op",
        )
    root = src.mesh.root_mesh
    ndim = len(src.shape)
    x, cur = _resolve_partials(x, src, keep=dst.partial_mesh_dims)
    lead = len(dst.partial_mesh_dims)
    cur_shard, dst_shard = _shard_map(cur), _shard_map(dst.root_placements)
    cur_pad = {d: x.shape[lead + d] for d in range(ndim)}

    # A dim sharded before and after with different padding goes through
    # Replicate first, so that its padding changes where it is local.
    clash = [
        d for d in cur_shard
        if d in dst_shard and cur_pad[d] != dst.padded_size(d)
    ]
    if clash:
        for d in clash:
            cur[cur_shard[d]] = Replicate()
        layout = physical_layout(root, cur, ndim)
        x = dtensor.relayout(x, layout)
        x = _resize_dims(x, lead, {d: src.shape[d] for d in clash}, layout)
        cur_pad.update({d: src.shape[d] for d in clash})
        cur_shard = _shard_map(cur)

    # Pad dims about to be sharded (they are replicated now, so it is local).
    grow = {
        d: dst.padded_size(d)
        for d in dst_shard
        if d not in cur_shard and cur_pad[d] != dst.padded_size(d)
    }
    x = _resize_dims(x, lead, grow, physical_layout(root, cur, ndim))
    x = dtensor.relayout(x, dst.tf_layout)
    # Drop the padding of dims that are replicated now.
    shrink = {
        d: src.shape[d]
        for d in range(ndim)
        if d not in dst_shard and x.shape[lead + d] != src.shape[d]
    }
    return _resize_dims(x, lead, shrink, dst.tf_layout)
