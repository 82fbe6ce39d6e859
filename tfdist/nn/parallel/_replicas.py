"""Model replicas that may differ: one stacked variable ``[R, *shape]`` per parameter, row ``r`` on
data-parallel device ``r``.

A TF DTensor variable has one global value: a replicated layout promises
equal copies, and TF reads one of them.  Replicas that diverge (local SGD)
are therefore stored as a *static* stacked variable sharded on dp -- each
device holds its own row, a plain layout TF computes with as such -- and
the model runs per replica (``tfdist.tensor._per_device``).  Averaging the
replicas is a mean over the stacked axis: one all-reduce, as torch's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _registry

__all__ = ["Replicas", "replica_mean", "replica_sum", "counter", "replicas_of", "run_if"]

UNSHARDED = dtensor.UNSHARDED


@dataclasses.dataclass
class Replicas:
    """One module's replicas: ``stacked[i]`` holds ``R`` copies of ``originals[i]``."""

    originals: list[Any]
    stacked: list[Any]
    mesh: dtensor.Mesh
    dp: str

    @property
    def count(self) -> int:
        return self.mesh.dim_size(self.dp)

    def stacked_layout(self, rank: int) -> dtensor.Layout:
        """The layout of a stacked tensor of ``rank`` dims (the replica axis first)."""
        return dtensor.Layout([self.dp] + [UNSHARDED] * (rank - 1), self.mesh)


def replica_mean(stacked: tf.Tensor, mesh: dtensor.Mesh, dp: str, dtype: tf.DType | None = None,
                 ) -> tuple[tf.Tensor, tf.Tensor]:
    """(the mean of the rows of ``stacked`` ``[R(dp), ...]``, replicated; every row set to it).

    The sum over the dp-sharded axis is one all-reduce; each device then
    keeps its row of the broadcast mean (local).  ``dtype``: the dtype the
    reduction runs in (a compressing hook's float16, divided first so the
    sum cannot overflow).
    """
    rows = stacked.shape[0]
    if dtype is None:
        mean = _replicated_sum(stacked, mesh) / tf.cast(rows, stacked.dtype)
    else:
        mean = tf.cast(_replicated_sum(tf.cast(stacked, dtype) / tf.cast(rows, dtype), mesh), stacked.dtype)
    return mean, _every_row(mean, stacked.shape, mesh, dp)


def replica_sum(stacked: tf.Tensor, mesh: dtensor.Mesh, dp: str) -> tf.Tensor:
    """Every row of a stacked ``[R(dp), ...]`` replaced by the sum of the rows (one all-reduce)."""
    return _every_row(_replicated_sum(stacked, mesh), stacked.shape, mesh, dp)


def _replicated_sum(stacked: tf.Tensor, mesh: dtensor.Mesh) -> tf.Tensor:
    """The sum over the dp-sharded axis 0, replicated: TF's all-reduce."""
    return dtensor.relayout(tf.reduce_sum(stacked, axis=0), dtensor.Layout.replicated(mesh, stacked.shape.rank - 1))


def _every_row(value: tf.Tensor, shape: tf.TensorShape, mesh: dtensor.Mesh, dp: str) -> tf.Tensor:
    """``value`` as every row of a stacked ``shape`` on dp: each device keeps its own row (local)."""
    spread = tf.broadcast_to(tf.expand_dims(value, 0), shape)
    return dtensor.relayout(spread, dtensor.Layout([dp] + [UNSHARDED] * (len(shape) - 1), mesh))


def counter(mesh: dtensor.Mesh, start: int = 0) -> dtensor.DVariable:
    """An int64 step counter on ``mesh`` (replicated) starting at ``start``, made outside any traced step."""
    with tf.init_scope():
        zero = dtensor.call_with_layout(tf.zeros, dtensor.Layout.replicated(mesh, 0), shape=[], dtype=tf.int64)
        return dtensor.DVariable(zero + start, trainable=False)


def replicas_of(variable: Any) -> tuple[Any, Replicas] | None:
    """(the module variable, its module's replicas) when ``variable`` is a stacked replica variable."""
    state = _registry.variable_if_any(variable)
    return None if state is None else state.replicas_of


def run_if(pred: tf.Tensor, then: Callable[[], None]) -> None:
    """``then()`` when ``pred`` holds: a Python branch eagerly, ``tf.cond`` in a traced step (so a
    step traced once averages on the right iterations, and communicates only on those)."""
    if not tf.inside_function():
        if bool(pred):
            then()
        return

    def taken():
        then()
        return tf.constant(True)

    tf.cond(pred, taken, lambda: tf.constant(False))
