"""Raw relayouts of TF DTensors that dodge TF DTensor 2.21's mis-lowerings.

One mesh dim per relayout, and all-to-alls of rank >= 4 tensors routed
through dim 0 (see ``move_mesh_dim``).  Used by the redistribute executor
and by tfdist's own relayouts of Keras variables and activations.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor import _comm_events
from tfdist.tensor._redistribute._byte_gather import all_gather

__all__ = ["REDUCERS", "reduce_partial", "move_mesh_dim", "as_reduce_scatter", "reduce_scatter_move", "relayout", "relayout_traced"]

REDUCERS = {
    "sum": tf.math.reduce_sum,
    "avg": tf.math.reduce_mean,
    "product": tf.math.reduce_prod,
    "max": tf.math.reduce_max,
    "min": tf.math.reduce_min,
}


def reduce_partial(x: tf.Tensor, op: str, axes: list[int]) -> tf.Tensor:
    """Reduces the stacked Partial ``axes`` of ``x`` with ``op``, as torch's all-reduce does.

    A bool Partial reduces as torch's (gloo, NCCL) does: ``sum``/``max`` are a logical or,
    ``product``/``min`` a logical and, and ``avg`` is refused (torch: "result type Float can't be
    cast to the desired output type Bool").  TF DTensor expands no reduction of bools across
    devices, so the bools travel as float16 (max/min; 2 bytes, TF has no 1-byte all-reduce).
    """
    if x.dtype != tf.bool:
        return REDUCERS[op](x, axis=axes)
    if op == "avg":
        raise TypeError("a Partial('avg') DTensor of dtype bool cannot be reduced (the mean of bools is "
                        "not a bool, as in torch); use Partial('sum') (logical or) or Partial('min') "
                        "(logical and), or cast to a number first.")
    reducer = tf.math.reduce_max if op in ("sum", "max") else tf.math.reduce_min
    return tf.cast(reducer(tf.cast(x, tf.float16), axis=axes), tf.bool)


def move_mesh_dim(x: tf.Tensor, specs: list[str], b: int, c: int, mesh: dtensor.Mesh) -> tuple[tf.Tensor, list[str]]:
    """One all-to-all: the mesh dim sharding physical dim ``b`` moves onto ``c``.

    TF DTensor 2.21 computes wrong values for an all-to-all relayout of a
    rank >= 4 tensor when another mesh dim shards a third dim and neither
    moved dim is dim 0 (docs/tf_dtensor_repros/all_to_all_wrong_values.py);
    moves to or from dim 0 are right.  So such a tensor is transposed (a local
    op) to put ``b`` and ``c`` first, moved, and transposed back.
    """
    if x.dtype not in _MOVES_NATIVELY:
        return _move_carried(x, specs, b, c, mesh)
    new = list(specs)
    new[c], new[b] = specs[b], dtensor.UNSHARDED
    if 0 not in (b, c) and len(specs) >= 4:
        perm = [b, c] + [d for d in range(len(specs)) if d not in (b, c)]
        inverse = [perm.index(d) for d in range(len(perm))]
        xt = dtensor.relayout(tf.transpose(x, perm), dtensor.Layout([specs[d] for d in perm], mesh))
        yt = dtensor.relayout(xt, dtensor.Layout([new[d] for d in perm], mesh))
        x = tf.transpose(yt, inverse)
    return dtensor.relayout(x, dtensor.Layout(new, mesh)), new


# TF lowers CollectiveAllToAllV2 for floats and 32/64-bit signed integers only ("operand #0 must be
# tensor of floating-point or 32/64-bit signed integer values", tensorflow/dtensor/mlir/collectives.cc)
_MOVES_NATIVELY = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64})
_SAME_SIZE_CARRIER = {tf.int16: tf.float16, tf.uint16: tf.float16, tf.uint32: tf.int32, tf.uint64: tf.int64,
                      tf.complex64: tf.int64}


def _move_carried(x: tf.Tensor, specs: list[str], b: int, c: int, mesh: dtensor.Mesh) -> tuple[tf.Tensor, list[str]]:
    """``move_mesh_dim`` for a dtype TF's all-to-all does not carry: the same bits as a type it
    does (16/32/64-bit integers, complex64), complex128 by an all-gather and a local slice (k times
    an all-to-all's bytes), and 1-byte types (bool, int8, uint8) as float16, which holds each of their values exactly
    (twice the bytes: TF has no 1-byte all-to-all, and pairing bytes would need an even last dim)."""
    if x.dtype in _SAME_SIZE_CARRIER:
        moved, new = move_mesh_dim(tf.bitcast(x, _SAME_SIZE_CARRIER[x.dtype]), specs, b, c, mesh)
        return tf.bitcast(moved, x.dtype), new
    if x.dtype == tf.complex128:
        # no 16-byte type to carry it, and a rank-changing bitcast fails TF DTensor's SPMD expansion
        # ("op output inconsistent with the provided layout"): gather dim b, then keep c's slice
        whole = list(specs)
        whole[b] = dtensor.UNSHARDED
        new = list(whole)
        new[c] = specs[b]
        return dtensor.relayout(all_gather(x, list(specs), whole, mesh), dtensor.Layout(new, mesh)), new
    if x.dtype in (tf.bool, tf.int8, tf.uint8):
        moved, new = move_mesh_dim(tf.cast(x, tf.float16), specs, b, c, mesh)
        return tf.cast(moved, x.dtype), new
    raise TypeError(f"a DTensor of dtype {x.dtype.name} cannot change which tensor dim a mesh dim shards: "
                    "TF DTensor's all-to-all carries numbers only.")


@contextlib.contextmanager
def as_reduce_scatter(output_bytes: float | None, k: int) -> Iterator[None]:
    """Marks the all-to-all run inside as torch's ``reduce_scatter_tensor`` for CommDebugMode.

    Eagerly the execution is reported; in a graph its relayout gets a
    registered name scope (``_comm_events``).  ``output_bytes`` is the
    all-to-all's output per device (None if the shape is dynamic), ``k``
    its group size.
    """
    marker = ("reduce_scatter_tensor", "CollectiveAllToAllV2", output_bytes, k)
    if tf.executing_eagerly():
        yield
        if _comm_events.listening():
            _comm_events.report(*marker)
    else:
        with tf.name_scope(_comm_events.graph_scope(*marker)):
            yield


def reduce_scatter_move(x: tf.Tensor, specs: list[str], b: int, c: int, mesh: dtensor.Mesh) -> tuple[tf.Tensor, list[str]]:
    """The all-to-all of a reduce-scatter: a stacked Partial axis ``b`` (sharded on its mesh
    dim) moves onto dim ``c``; the caller reduces axis ``b`` locally afterwards.

    ``move_mesh_dim``, marked for CommDebugMode as ``reduce_scatter_tensor``.
    """
    k = mesh.dim_size(specs[b])
    shards = math.prod(mesh.dim_size(s) for s in specs if s != dtensor.UNSHARDED)
    size = None if None in x.shape.as_list() else math.prod(x.shape.as_list()) / shards * x.dtype.size
    with as_reduce_scatter(size, k):
        return move_mesh_dim(x, specs, b, c, mesh)


def relayout(x: tf.Tensor, layout: dtensor.Layout, source: dtensor.Layout | None = None) -> tf.Tensor:
    """``dtensor.relayout`` that gathers one mesh dim at a time and moves mesh dims safely.

    For tfdist's own relayouts of raw TF DTensors (Keras variables and
    activations, host reads): a single relayout that gathers two mesh dims
    at once fails to compile under the CollectiveGatherV2 lowering tfdist
    enables (``_byte_gather``, ``_execute``), and an all-to-all between two
    dims other than dim 0 of a rank >= 4 tensor computes wrong values
    (``move_mesh_dim``), so a mesh dim that only moves goes through
    ``move_mesh_dim``.  ``source`` is the current layout (read from
    ``x`` in eager mode when not given).
    """
    if x.shape.is_fully_defined() and x.shape.num_elements() == 0 and tf.executing_eagerly():
        # no values to move, and TF's gather of an empty shard kills the process
        return dtensor.call_with_layout(tf.zeros, layout, shape=x.shape, dtype=x.dtype)
    if source is None:
        source = dtensor.fetch_layout(x)
    specs = list(source.sharding_specs)
    wanted = list(layout.sharding_specs)
    for b, name in enumerate(source.sharding_specs):
        # a mesh dim that only changes tensor dim: one all-to-all (with _move_mesh_dim's workaround)
        if name != dtensor.UNSHARDED and wanted[b] != name and name in wanted:
            c = wanted.index(name)
            if specs[c] == dtensor.UNSHARDED and specs[b] == name:
                x, specs = move_mesh_dim(x, specs, b, c, source.mesh)
    for d, (have, want) in enumerate(zip(list(specs), wanted)):
        if have != dtensor.UNSHARDED and have != want:
            specs[d] = dtensor.UNSHARDED
            x = dtensor.relayout(x, dtensor.Layout(list(specs), source.mesh))
    return dtensor.relayout(x, layout)


def relayout_traced(x: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """``dtensor.relayout`` of a traced rank-2 tensor whose layout TF DTensor decides only after
    tracing, gathering one mesh dim at a time.

    With the CollectiveGatherV2 lowering on, TF DTensor 2.21 computes wrong values for a relayout
    that gathers two mesh dims at once when they shard the tensor in the reverse of the mesh's
    order ((model, batch) on a (batch, model) mesh; docs/tf_dtensor_repros/all_gather_two_mesh_dims.py),
    and it inserts such relayouts itself where a value meets a variable of another layout (an
    optimizer's replicated factored moments of a (model, batch, None) kernel).  A dim ``layout``
    keeps whole is unsharded in a relayout of its own first, the other dim kept as it is (TF's
    "match" spec), so neither relayout gathers more than one mesh dim; where that dim is whole
    already the step is an identity.  TF accepts one "match" per layout ("Attempted to shard two
    or more tensor dimensions over mesh dimension match", tensor_layout.cc), which stages rank 2;
    rank >= 4 is staged by ``_relayout_rank4``; rank 3 gets the plain relayout.
    """
    specs = list(layout.sharding_specs)
    if len(specs) >= 4:
        return _relayout_rank4(x, layout)
    if len(specs) != 2 or dtensor.UNSHARDED not in specs:
        return dtensor.relayout(x, layout)
    whole = specs.index(dtensor.UNSHARDED)
    step = [dtensor.MATCH, dtensor.MATCH]
    step[whole] = dtensor.UNSHARDED  # gathers what shards that dim, keeps the other's
    return dtensor.relayout(dtensor.relayout(x, dtensor.Layout(step, layout.mesh)), layout)


def _relayout_rank4(x: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """A traced relayout of a rank >= 4 tensor done on a rank-3 view of it.

    TF moves a mesh dim between two non-leading dims of a rank >= 4 tensor wrongly, silently
    (docs/tf_dtensor_repros/all_to_all_wrong_values.py: ``(dp, -, tp, -)`` from
    ``(dp, tp, -, -)``; FSDP's product of keras-hub Bert's attention output met it), and a traced
    tensor's layout is known only to TF, so the move cannot be staged around.  Rank 3 moves are
    right, so where ``layout`` leaves dims 1..rank-3 whole the leading dims are merged into one
    (a reshape: local where only the outer merged dim is sharded), the rank-3 view is
    relayouted, and the result is split back.  A tensor already laid out as ``layout`` meets no
    collective on the way."""
    specs = list(layout.sharding_specs)
    rank = len(specs)
    if not x.shape.is_fully_defined() or any(s != dtensor.UNSHARDED for s in specs[1:rank - 2]):
        return dtensor.relayout(x, layout)
    dims = x.shape.as_list()
    view = tf.reshape(x, [-1] + dims[rank - 2:])
    view = dtensor.relayout(view, dtensor.Layout([specs[0]] + specs[rank - 2:], layout.mesh))
    return dtensor.relayout(tf.reshape(view, dims), layout)
