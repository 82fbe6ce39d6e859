"""HSDP: a module run once per replica group, vectorised over the replicate mesh dim.

On a 2-D ``(replicate, shard)`` mesh torch's HSDP has ``R`` replica groups of
``S`` ranks: parameters sharded over ``shard`` (the same shards in every
group), the batch over all ``R x S`` ranks, each group running FSDP over
``shard`` on its rows; gradients are reduce-scattered over ``shard`` and the
shards all-reduced over ``replicate``.

A TF DTensor layout names one mesh dim per tensor dim, so a ``[B, ...]``
batch cannot be sharded over both.  Here it is split to ``[R, B/R, ...]``
laid out ``(replicate, shard, ...)`` (a local slice of a batch on
``replicate``) and the module runs under ``tf.vectorized_map`` over the
leading axis: each group's program is FSDP over ``shard`` as on a 1-D mesh,
and every op of it gets the leading axis on ``replicate``.  TF's vectoriser
has no converter for DTensor's ``Relayout``; while a group's program is
vectorised, tfdist's (a with-block row of ``tfdist._patches``) relayouts the
stacked tensor with its leading axis on ``replicate``.

TF's vectoriser drops ``tf.custom_gradient`` (a gradient taken outside a
vectorised function differentiates the vectorised ops), and FSDP's
reduce-scatter is a custom gradient.  So the backward vectorises each
group's own gradient computation (a tape inside the vectorised function):
the group's forward runs again there (with ``reshard_after_forward``
FSDP gathers again in the backward anyway, and the gathered copy serves
both), its parameter gradients come out reduce-scattered over ``shard``,
stacked ``[R, *shard]``, and a sum over the stacked axis is the all-reduce
over ``replicate``: torch's HSDP bytes.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.ops.parallel_for import pfor

from tfdist import _patches
from tfdist.tensor import _random
from tfdist.tensor._redistribute import relayout

__all__ = ["replica_groups_call", "in_replica_group"]

UNSHARDED = dtensor.UNSHARDED
_CONVERTER = "tensorflow.python.ops.parallel_for.pfor:_pfor_converter_registry.Relayout"
_GROUP = threading.local()  # .dim: the replicate mesh dim while a group's program is traced


def in_replica_group() -> bool:
    """True while a replica group's program is traced (a nested HSDP module runs as plain FSDP)."""
    return getattr(_GROUP, "dim", None) is not None


def _relayout_stacked(original: Any, pfor_input: Any) -> Any:
    """The vectorised ``Relayout``: the stacked tensor to the op's layout behind the replicate dim.
    A mesh dim that moves between tensor dims goes through tfdist's ``relayout`` (TF's all-to-all
    of a rank >= 4 tensor between two dims other than dim 0 is wrong, and the leading axis makes
    a group's rank-3 move such a one), when the source layout is known: the input is itself a
    relayout's output, as tfdist's collectives make them."""
    dim = _GROUP.dim
    stacked = pfor_input.stacked_input(0)
    layout = dtensor.Layout.from_string(pfor_input.get_attr("layout"))
    target = dtensor.Layout([dim, *layout.sharding_specs], layout.mesh)
    producer = pfor_input.op.inputs[0].op
    # the op's own name scope: CommDebugMode names a collective by it (a reduce-scatter's all-to-all)
    with tf.name_scope(pfor_input.op.name.rpartition("/")[0] + "/"):
        return pfor.wrap(_stacked_relayout(stacked, target, producer, dim), True)


def _stacked_relayout(stacked: tf.Tensor, target: dtensor.Layout, producer: Any, dim: str) -> tf.Tensor:
    if producer.type == "Relayout":
        source = dtensor.Layout.from_string(producer.get_attr("layout"))
        return relayout(stacked, target, source=dtensor.Layout([dim, *source.sharding_specs], source.mesh))
    return dtensor.relayout(stacked, target)


def _softmax_stacked(original: Any, pfor_input: Any) -> Any:
    """A vectorised (log-)softmax over the last dim; above rank 5 from exp and sums, because TF's
    oneDNN kernel refuses more dims ("Input dims must be <= 5", mkl_softmax_op.cc) and a group
    axis on an attention's 5-D scores (grouped-query heads) makes 6."""
    x = pfor_input.stacked_input(0)
    if x.shape.rank is not None and x.shape.rank <= 5:
        return original(pfor_input)
    shifted = x - tf.stop_gradient(tf.reduce_max(x, axis=-1, keepdims=True))
    total = tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True)
    out = shifted - tf.math.log(total) if pfor_input.op_type == "LogSoftmax" else tf.exp(shifted) / total
    return pfor.wrap(out, True)


_SOFTMAX = tuple(f"tensorflow.python.ops.parallel_for.pfor:_pfor_converter_registry.{op}"
                 for op in ("Softmax", "LogSoftmax"))


@contextlib.contextmanager
def _vectorising(replicate: str) -> Iterator[None]:
    before = getattr(_GROUP, "dim", None)
    _GROUP.dim = replicate
    try:
        with contextlib.ExitStack() as scopes:
            scopes.enter_context(_patches.scoped(_CONVERTER, _relayout_stacked))
            for name in _SOFTMAX:
                scopes.enter_context(_patches.scoped(name, _softmax_stacked))
            yield
    finally:
        _GROUP.dim = before


def _split(x: tf.Tensor, mesh: dtensor.Mesh, replicate: str, shard: str) -> tf.Tensor:
    """``[B, ...]`` -> ``[R, B/R, ...]`` laid out ``(replicate, shard, ...)`` (``shard`` when the
    group's rows divide evenly): local slices of a batch sharded on ``replicate``."""
    groups, rank = mesh.dim_size(replicate), x.shape.rank
    rest = [UNSHARDED] * (rank - 1)
    x = dtensor.relayout(x, dtensor.Layout([replicate] + rest, mesh))
    rows = x.shape[0] // groups
    x = dtensor.relayout(tf.reshape(x, [groups, rows] + x.shape.as_list()[1:]),
                         dtensor.Layout([replicate, UNSHARDED] + rest, mesh))
    rows_on = shard if rows % mesh.dim_size(shard) == 0 else UNSHARDED
    return dtensor.relayout(x, dtensor.Layout([replicate, rows_on] + rest, mesh))


def _merge(xs: tf.Tensor, mesh: dtensor.Mesh, replicate: str) -> tf.Tensor:
    """``[R, B/R, ...]`` -> ``[B, ...]`` on ``replicate`` (the inverse of ``_split``; the rows
    a group split over ``shard`` are gathered over it)."""
    rest = [UNSHARDED] * (xs.shape.rank - 2)
    xs = dtensor.relayout(xs, dtensor.Layout([replicate, UNSHARDED] + rest, mesh))
    dims = xs.shape.as_list()
    shape = [dims[0] * dims[1]] + dims[2:] if None not in dims else tf.concat([[-1], tf.shape(xs)[2:]], 0)
    merged = tf.reshape(xs, shape)
    return dtensor.relayout(merged, dtensor.Layout([replicate] + rest, mesh))


def _batch_leaves(x: Any, what: str) -> list[tf.Tensor]:
    leaves = tf.nest.flatten(x)
    bad = [leaf for leaf in leaves if not isinstance(leaf, tf.Tensor) or leaf.shape.rank in (None, 0)]
    if bad or not leaves:
        raise ValueError(f"HSDP runs the module per replica group: its {what} must be tensors with the batch in "
                         f"dim 0. Received: {bad[0] if bad else x!r}")
    return leaves


def _vectorised(fn: Callable, args: tuple, replicate: str) -> Any:
    with _vectorising(replicate):
        try:
            return tf.vectorized_map(fn, args, fallback_to_while_loop=False)
        except ValueError as e:
            raise ValueError(
                "HSDP runs the module once per replica group with TF's vectoriser (tf.vectorized_map), "
                f"which cannot vectorise an op of this module: {str(e).splitlines()[0]}"
            ) from e


def replica_groups_call(fn: Callable[[Any], Any], x: Any, *, mesh: dtensor.Mesh, replicate: str, shard: str) -> Any:
    """``fn(x_g)`` on each replica group's rows, vectorised over ``replicate``; the outputs
    (a nest of batch-major tensors) come back as ``[B, ...]`` on ``replicate``.

    Example (a module whose parameters ``fully_shard`` sharded over ``"s"``)::

        y = replica_groups_call(model_call, x, mesh=mesh.to_tf(), replicate="r", shard="s")
    """
    leaves = _batch_leaves(x, "inputs")
    n_x = len(leaves)
    floating = [i for i, leaf in enumerate(leaves) if leaf.dtype.is_floating or leaf.dtype.is_complex]
    structure: list = []  # the outputs' nest, known once a group's program is traced
    seeds: list = []  # Keras' seeds the forward drew, replayed by the backward's trace
    # each group's index, row g on its group (a range pinned replicated first: DTensor cannot expand
    # a sharded Range)
    groups = dtensor.relayout(dtensor.relayout(tf.range(mesh.dim_size(replicate)), dtensor.Layout.replicated(mesh, 1)),
                              dtensor.Layout([replicate], mesh))

    def group(args, replay=False):
        """One group's program: ``args`` its rows, then its index (random draws start at its rows)."""
        with _random.vectorised_group(args[n_x], seeds, replay):
            out = fn(tf.nest.pack_sequence_as(x, list(args[:n_x])))
        structure[:] = [out]
        return tuple(_batch_leaves(out, "outputs"))

    @tf.custom_gradient
    def run(*leaves):
        xs = tuple(_split(leaf, mesh, replicate, shard) for leaf in leaves)
        ys = _vectorised(group, (*xs, groups), replicate)
        outputs = [_merge(y, mesh, replicate) for y in ys]

        def grad(*dys, variables=None):
            variables = list(variables or [])
            dys = tuple(_split(tf.cast(dy, y.dtype), mesh, replicate, shard) for dy, y in zip(dys, outputs))

            def group_grads(args):
                xs_g, dys_g = args[:n_x + 1], args[n_x + 1:]
                with tf.GradientTape() as tape:
                    tape.watch([xs_g[i] for i in floating])
                    ys_g = group(xs_g, replay=True)
                return tuple(tape.gradient(list(ys_g), [xs_g[i] for i in floating] + variables,
                                           output_gradients=list(dys_g),
                                           unconnected_gradients=tf.UnconnectedGradients.ZERO))

            grads = list(_vectorised(group_grads, (*xs, groups, *dys), replicate)) if (floating or variables) else []
            dxs: list = [None] * n_x
            for i, g in zip(floating, grads):
                dxs[i] = _merge(g, mesh, replicate)
            # each group's gradient is reduce-scattered over shard already: the sum over the
            # stacked axis is the all-reduce over replicate
            return dxs, [tf.reduce_sum(g, axis=0) for g in grads[len(floating):]]

        return tuple(outputs), grad

    outputs = run(*leaves)
    return tf.nest.pack_sequence_as(structure[0], list(outputs))
