"""The redistribute executor: applies a :class:`Plan`'s ops to a physical TF DTensor.

Every op is local TF work or one TF relayout; nothing here decides what to
move (``_plan`` did).
"""

from __future__ import annotations

import functools
import logging
import math
import os

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor._layout import DTensorSpec
from tfdist.tensor._redistribute._byte_gather import all_gather
from tfdist.tensor._redistribute._moves import move_mesh_dim, reduce_partial, reduce_scatter_move
from tfdist.tensor._redistribute._plan import check_transition, plan
from tfdist.tensor._redistribute._steps import (
    Gather, GatherPieces, Merge, Move, Op, Plan, Reduce, Relayout, Resize, Split,
)

__all__ = ["run", "redistribute_physical", "logger"]

logger = logging.getLogger("tfdist.redistribute")
if "redistribute" in os.environ.get("TFDIST_LOGS", "").replace(" ", "").split(","):
    logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        logging.basicConfig()


@functools.lru_cache(maxsize=4096)
def _layout(specs: tuple[str, ...], mesh: dtensor.Mesh) -> dtensor.Layout:
    return dtensor.Layout(list(specs), mesh)


@functools.singledispatch
def _apply(op: Op, x: tf.Tensor, mesh: dtensor.Mesh) -> tf.Tensor:
    raise TypeError(f"no executor for redistribute op {op!r}")


@_apply.register
def _(op: Relayout, x, mesh):
    return dtensor.relayout(x, _layout(op.specs, mesh))


@_apply.register
def _(op: Resize, x, mesh):
    have = x.shape[op.axis]
    if op.size < have:
        size = list(x.shape)
        size[op.axis] = op.size
        x = tf.slice(x, [0] * len(size), size)
    else:
        pads = [[0, 0] for _ in x.shape]
        pads[op.axis][1] = op.size - have
        x = tf.pad(x, pads)
    return dtensor.relayout(x, _layout(op.specs, mesh))


@_apply.register
def _(op: Move, x, mesh):
    move = reduce_scatter_move if op.reduce_scatter else move_mesh_dim
    return move(x, list(op.specs), op.src, op.dst, mesh)[0]


@_apply.register
def _(op: Gather, x, mesh):
    new = list(op.specs)
    new[op.axis] = dtensor.UNSHARDED
    return all_gather(x, list(op.specs), new, mesh)


@_apply.register
def _(op: Reduce, x, mesh):
    return reduce_partial(x, op.op, list(op.axes))


@_apply.register
def _(op: Merge, x, mesh):
    shape = x.shape.as_list()
    merged = shape[:op.first] + [math.prod(shape[op.first:op.first + op.count])] \
        + shape[op.first + op.count:]
    return dtensor.relayout(tf.reshape(x, merged), _layout(op.specs, mesh))


@_apply.register
def _(op: Split, x, mesh):
    shape = x.shape.as_list()
    return dtensor.relayout(tf.reshape(x, shape[:op.axis] + list(op.parts) + shape[op.axis + 1:]),
                            _layout(op.specs, mesh))


@_apply.register
def _(op: GatherPieces, x, mesh):
    """``x`` holds ``[k1, rows]`` at ``op.axis``: one zero row goes on ``axis + 1`` (the pad slot),
    the two axes go to the front (a local transpose), ``tf.gather(..., batch_dims=1)`` picks each
    piece's rows, and the axes go back.  No collective: each device reads its own piece."""
    axis, specs = op.axis, list(op.specs)
    pads = [[0, 0] for _ in x.shape]
    pads[axis + 1][1] = 1
    x = dtensor.relayout(tf.pad(x, pads), dtensor.Layout(specs, mesh))  # pinned (see Resize)
    rank = x.shape.rank
    perm = [axis, axis + 1] + [i for i in range(rank) if i not in (axis, axis + 1)]
    front = dtensor.relayout(tf.transpose(x, perm), dtensor.Layout([specs[i] for i in perm], mesh))
    index = _eager_index(op, mesh) if tf.executing_eagerly() else tf.constant(op.index)
    picked = tf.gather(front, index, axis=1, batch_dims=1)
    back = [perm.index(i) for i in range(rank)]
    return dtensor.relayout(tf.transpose(picked, back), dtensor.Layout(specs, mesh))


@functools.lru_cache(maxsize=1024)
def _eager_index(op: GatherPieces, mesh: dtensor.Mesh) -> tf.Tensor:
    """The op's row index as a replicated DTensor (TF DTensor refuses a host tensor beside a
    DTensor in an eager op, ``dtensor_device.cc``), made once per plan."""
    return dtensor.copy_to_mesh(tf.constant(op.index), dtensor.Layout.replicated(mesh, 2))


def run(p: Plan, x: tf.Tensor) -> tf.Tensor:
    """Applies ``p``'s ops to the physical tensor ``x``."""
    for op in p.ops:
        x = _apply(op, x, p.mesh)
    return x


def _empty(dtype: tf.DType, dst: DTensorSpec) -> tf.Tensor:
    """An empty tensor's physical form for ``dst``: nothing to move (TF's collectives abort
    the process on empty buffers, so none may run)."""
    zeros = tf.zeros(dst.physical_shape, dtype)
    if tf.executing_eagerly():
        zeros = dtensor.copy_to_mesh(zeros, dtensor.Layout.replicated(dst.tf_layout.mesh, len(dst.physical_shape)))
    return dtensor.relayout(zeros, dst.tf_layout)


def redistribute_physical(x: tf.Tensor, src: DTensorSpec, dst: DTensorSpec) -> tf.Tensor:
    """Returns the physical tensor for ``dst`` holding the same global values as ``x``."""
    if src.root_placements == dst.root_placements:
        return x
    check_transition(src, dst)
    if 0 in src.shape:
        return _empty(x.dtype, dst)
    p = plan(src, dst, x.dtype.size)
    if not (x.dtype.is_floating or x.dtype.is_integer or x.dtype.is_complex or x.dtype == tf.bool):
        moves = [s for s in p.steps if s.collective != "none"]
        if moves:  # TF DTensor's collectives carry numbers only (a raw MLIR error otherwise)
            raise TypeError(
                f"a DTensor of dtype {x.dtype.name} cannot be moved from {src.placements} to "
                f"{dst.placements}: that needs {moves[0].collective} on mesh dim {moves[0].mesh_dim!r}, "
                "and TF DTensor collectives carry numbers only. Keep such tensors replicated "
                "(distribute_tensor(x, mesh, [Replicate()])) or encode them as numbers first."
            )
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("redistribute %s: %s", src.shape, "; ".join(map(str, p.steps)) or "local")
    return run(p, x)
