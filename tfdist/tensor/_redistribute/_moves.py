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

__all__ = ["REDUCERS", "move_mesh_dim", "as_reduce_scatter", "reduce_scatter_move", "relayout", "relayout_traced"]

REDUCERS = {
    "sum": tf.math.reduce_sum,
    "avg": tf.math.reduce_mean,
    "product": tf.math.reduce_prod,
    "max": tf.math.reduce_max,
    "min": tf.math.reduce_min,
}


def move_mesh_dim(x: tf.Tensor, specs: list[str], b: int, c: int, mesh: dtensor.Mesh) -> tuple[tf.Tensor, list[str]]:
    """One all-to-all: the mesh dim sharding physical dim ``b`` moves onto ``c``.

    TF DTensor 2.21 computes wrong values for an all-to-all relayout of a
    rank >= 4 tensor when another mesh dim shards a third dim and neither
    moved dim is dim 0 (docs/tf_dtensor_repros/all_to_all_wrong_values.py);
    moves to or from dim 0 are right.  So such a tensor is transposed (a local
    op) to put ``b`` and ``c`` first, moved, and transposed back.
    """
    new = list(specs)
    new[c], new[b] = specs[b], dtensor.UNSHARDED
    if 0 not in (b, c) and len(specs) >= 4:
        perm = [b, c] + [d for d in range(len(specs)) if d not in (b, c)]
        inverse = [perm.index(d) for d in range(len(perm))]
        xt = dtensor.relayout(tf.transpose(x, perm), dtensor.Layout([specs[d] for d in perm], mesh))
        yt = dtensor.relayout(xt, dtensor.Layout([new[d] for d in perm], mesh))
        x = tf.transpose(yt, inverse)
    return dtensor.relayout(x, dtensor.Layout(new, mesh)), new


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
    or more tensor dimensions over mesh dimension match", tensor_layout.cc), which stages rank 2
    only; other ranks get the plain relayout.
    """
    specs = list(layout.sharding_specs)
    if len(specs) != 2 or dtensor.UNSHARDED not in specs:
        return dtensor.relayout(x, layout)
    whole = specs.index(dtensor.UNSHARDED)
    step = [dtensor.MATCH, dtensor.MATCH]
    step[whole] = dtensor.UNSHARDED  # gathers what shards that dim, keeps the other's
    return dtensor.relayout(dtensor.relayout(x, dtensor.Layout(step, layout.mesh)), layout)
