"""Products computed as torch computes them: a local product that is Partial, then one
collective (a reduce-scatter into a sequence shard, or an all-reduce).  Used for the
forward of row-parallel layers and the input gradient of column-parallel ones.

TF DTensor resolves a contraction over a sharded dim inside the op (an
all-reduce of the whole output); relayouting that result to a sequence
shard afterwards moves twice the bytes of torch's reduce-scatter, and in
2.21 it mis-propagates layouts in the backward pass
(docs/tf_dtensor_repros/rowwise_sequence_shard_output.py).  Here the
contracted dim ``K`` is split into ``[T, K/T]`` (``T`` = the tensor-parallel
degree; a local reshape, ``T`` sharded) and ``T`` is kept as a leading
output axis: each device's own product, the physical form of a
``Partial("sum")``.  The reduction then happens where torch's would:

* ``Shard(d)``: an all-to-all of the ``T`` axis onto dim ``d`` and a local
  sum -- the bytes of a ring reduce-scatter; its backward is the reverse
  all-to-all, the bytes of torch's all-gather.
* ``Replicate()``: a sum over the ``T`` axis, which TF runs as one
  all-reduce.

The column-parallel layer of sequence parallelism (``ColwiseParallel(
input_layouts=Shard(1))``) all-gathers its input; TF would resolve the
input's gradient inside the matmul gradient (an all-reduce, then a slice).
``gathered_product`` gives it torch's backward instead: the gradient product
as a Partial, reduce-scattered back onto the sequence.

A vocabulary-sharded ``Embedding`` is looked up the same way: each device
gathers its own rows for the ids in its range (zeros elsewhere), a Partial
of ``[batch, seq, dim]``; its gradient is a segment sum into the device's
rows -- no one-hot ``[batch, seq, vocab/T]`` either way.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor import _step_checks
from tfdist.tensor._layout import physical_layout
from tfdist.tensor._redistribute import reduce_scatter_move, relayout
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["add_bias_once", "gathered_product", "partial_einsum", "partial_lookup", "resolve_partial"]


def _tp_dim(ctx) -> int:
    """The root mesh dim of the (1-D) tensor-parallel mesh."""
    return ctx.mesh.root_dims[0]


def _stacked_layout(ctx, rank: int) -> dtensor.Layout:
    """Layout of a Partial on the TP mesh dim with ``rank`` logical dims (batch kept on dp)."""
    root = list(ctx.root_placements([Replicate()], rank))
    root[_tp_dim(ctx)] = Partial("sum")
    return physical_layout(ctx.root, root, rank)


def _split_axis(x: tf.Tensor, specs: Sequence[str], axis: int, parts: int, mesh) -> tf.Tensor:
    """Axis ``axis`` of ``x`` (sharded ``parts`` ways) -> ``[parts, n/parts]``, the first sharded: local."""
    shape = tf.unstack(tf.shape(x)) if None in x.shape.as_list() else x.shape.as_list()
    size = x.shape[axis]
    new_shape = list(shape[:axis]) + [parts, size // parts] + list(shape[axis + 1:])
    new_specs = list(specs[:axis]) + [specs[axis], dtensor.UNSHARDED] + list(specs[axis + 1:])
    return dtensor.relayout(tf.reshape(x, new_shape), dtensor.Layout(new_specs, mesh))


def partial_einsum(
    ctx, equation: str, x: tf.Tensor, kernel: tf.Tensor, letter: str,
    x_specs: Sequence[str], kernel_specs: Sequence[str],
) -> tf.Tensor:
    """``einsum(equation, x, kernel)`` with contracted ``letter`` sharded on the TP mesh dim,
    left as a stacked Partial ``[T, *out]``.

    Example: ``"bsk,kn->bsn"`` with ``k`` sharded runs ``"bstk,tkn->tbsn"``.
    """
    lhs, out = equation.split("->")
    inp, ker = lhs.split(",")
    t = next(c for c in "tzyxwvuqponmlkjihgfedcba" if c not in equation)
    parts = ctx.root.shape[_tp_dim(ctx)]
    mesh = ctx.root.to_tf()
    xs = _split_axis(x, x_specs, inp.index(letter), parts, mesh)
    ks = _split_axis(kernel, kernel_specs, ker.index(letter), parts, mesh)
    y = tf.einsum(f"{inp.replace(letter, t + letter)},{ker.replace(letter, t + letter)}->{t}{out}", xs, ks)
    return dtensor.relayout(y, _stacked_layout(ctx, len(out)))


def partial_lookup(ctx, ids: tf.Tensor, table: tf.Tensor) -> tf.Tensor:
    """Rows of a vocabulary-sharded ``table`` ``[V, D]`` for ``ids``, as a stacked Partial ``[T, *ids.shape, D]``.

    Device ``t`` owns rows ``[t V/T, (t+1) V/T)``: it gathers row ``id mod V/T``
    of its shard for every id and keeps those it owns (zeros for the others).
    """
    parts = ctx.root.shape[_tp_dim(ctx)]
    vocab, mesh = int(table.shape[0]), ctx.root.to_tf()
    rows = vocab // parts
    tp = ctx.root.axis_names[_tp_dim(ctx)]
    shard_layout = dtensor.Layout([tp] + [dtensor.UNSHARDED] * table.shape.rank, mesh)
    local_table = dtensor.relayout(tf.reshape(table, [parts, rows] + table.shape.as_list()[1:]), shard_layout)
    # as TF's gather on CPU: an id no device owns is an error, not zeros (eagerly raised now; in
    # a Keras step on a mesh clipped and raised on the host after the step: _step_checks)
    checked = tf.executing_eagerly() or _step_checks.active()
    ids = _step_checks.lookup_ids(ids, vocab, f"Embedding lookup: id {{value}} is not in [0, {vocab}).")
    rank = ids.shape.rank
    row = tf.math.floormod(ids, rows)  # the same on every device: always a valid row of a shard
    # dims [*ids, T, D]: T (the shard axis) after the ids' dims, so that TF DTensor's
    # UnsortedSegmentSum, which all-reduces over every mesh dim sharding the segment ids,
    # reduces over the batch's mesh dims only (what data parallelism needs anyway), never tp.
    to_ids_first = list(range(1, rank + 1)) + [0, rank + 1]

    @tf.custom_gradient
    def lookup(local_table):
        def grad(dy):
            # each device's rows summed by id: a local segment sum of the [*ids, D] gradient
            # (no one-hot, nothing of batch x seq x V/T); TF's gradient of the gather would
            # scatter into the whole [V, D] table and all-reduce it over tp.
            dy = tf.transpose(dtensor.relayout(dy, _stacked_layout(ctx, rank + 1)), to_ids_first)
            dshard = tf.math.unsorted_segment_sum(dy, row, rows)  # [rows, T, D]
            return dtensor.relayout(tf.transpose(dshard, [1, 0, 2]), shard_layout)

        with _step_checks.suspended():  # rows of the shard: in range by construction
            return tf.gather(local_table, row, axis=1), grad

    rows_out = lookup(local_table)
    # One factor per id, applied in one product (its gradient is one product too, and masks the
    # gradient rows the segment sum adds up): 1 for the ids this device owns, 0 for another
    # device's, NaN for an id no device owns where nothing checked the ids (a traced program
    # outside Keras' steps) -- not an error: raising inside a traced DTensor step would poison
    # TF's collective executor for the rest of the process.  Built on the [T, *ids] ids, not on
    # the [T, *ids, D] rows.
    owner = tf.expand_dims(tf.math.floordiv(ids, rows), 0)
    factor = tf.cast(tf.equal(owner, tf.reshape(tf.range(parts, dtype=tf.int32), [parts] + [1] * rank)), rows_out.dtype)
    if not checked and rows_out.dtype.is_floating:
        owned = tf.expand_dims(tf.logical_and(ids >= 0, ids < vocab), 0)
        factor = tf.where(owned, factor, tf.constant(float("nan"), rows_out.dtype))
    factor = dtensor.relayout(factor, _stacked_layout(ctx, rank))
    return dtensor.relayout(rows_out * tf.expand_dims(factor, -1), _stacked_layout(ctx, rank + 1))


def resolve_partial(ctx, stacked: tf.Tensor, placements: Sequence[Placement]) -> tf.Tensor:
    """A stacked Partial ``[T, *shape]`` -> ``placements`` on the TP mesh (Replicate or one Shard)."""
    rank = stacked.shape.rank - 1
    target = physical_layout(ctx.root, ctx.root_placements(placements, rank), rank)
    shard = next((p for p in placements if isinstance(p, Shard)), None)
    if shard is None:
        return _all_reduce(stacked, target, _stacked_layout(ctx, rank))
    d = shard.dim % rank
    size, parts = stacked.shape[d + 1], ctx.root.shape[_tp_dim(ctx)]
    if size is not None and size % parts:
        raise ValueError(
            f"layer {ctx.fqn!r}: output dim {d} of size {size} cannot be reduce-scattered over "
            f"mesh dim {ctx.root.axis_names[_tp_dim(ctx)]!r} ({parts}); choose sizes divisible "
            "by the tensor-parallel degree."
        )
    specs = list(_stacked_layout(ctx, rank).sharding_specs)
    moved, _ = reduce_scatter_move(stacked, specs, 0, d + 1, ctx.root.to_tf())
    return dtensor.relayout(tf.reduce_sum(moved, axis=0), target)


def add_bias_once(ctx, stacked: tf.Tensor, bias: Any) -> tf.Tensor:
    """``stacked`` (a Partial ``[T, *shape]``) plus ``bias`` counted once in the sum: added to
    device 0's partial only, so the reduced value is ``product + bias`` exactly."""
    if bias is None:
        return stacked
    parts, rank = stacked.shape[0], stacked.shape.rank - 1
    tp = ctx.root.axis_names[_tp_dim(ctx)]
    first = tf.reshape(tf.one_hot(0, parts, dtype=stacked.dtype), [parts] + [1] * rank)
    first = dtensor.relayout(first, dtensor.Layout([tp] + [dtensor.UNSHARDED] * rank, ctx.root.to_tf()))
    return dtensor.relayout(stacked + first * reads_as(bias, stacked.dtype), _stacked_layout(ctx, rank))


def _all_reduce(stacked: tf.Tensor, target: dtensor.Layout, stacked_layout: dtensor.Layout) -> tf.Tensor:
    """Sum of the stacked Partial axis (TF: one all-reduce).  Its gradient broadcasts the
    replicated gradient straight into the stacked layout: each device keeps its own slice
    (TF's own gradient tiles it to the whole stack on every device first)."""

    @tf.custom_gradient
    def reduce(stacked):
        def grad(dy):
            parts = tf.shape(stacked)[0]
            tiled = tf.broadcast_to(tf.expand_dims(dy, 0), tf.concat([[parts], tf.shape(dy)], 0))
            return dtensor.relayout(tiled, stacked_layout)

        return dtensor.relayout(tf.reduce_sum(stacked, axis=0), target), grad

    return reduce(stacked)


def gathered_product(
    ctx, equation: str, x: tf.Tensor, kernel: tf.Tensor, letter: str,
    arrives_as: Sequence[Placement], kernel_layout: dtensor.Layout,
) -> tf.Tensor:
    """``einsum(equation, all_gather(x), kernel)``, ``x`` arriving as ``arrives_as`` (a shard),
    ``letter`` the output feature dim the kernel shards on the TP mesh dim.

    Backward: the input gradient ``dy . kernel^T`` contracts the sharded
    ``letter``: computed as a Partial and reduce-scattered to ``arrives_as``
    (torch's backward of the all-gather), not all-reduced.
    """
    lhs, out = equation.split("->")
    inp, ker = lhs.split(",")
    rank_in, rank_out = len(inp), len(out)
    gathered = ctx.layout_of([Replicate()], rank_in)
    arrived = ctx.layout_of(arrives_as, rank_in)
    out_layout = ctx.layout_of([Shard(out.index(letter))], rank_out)

    @tf.custom_gradient
    def product(x, kernel):
        full = relayout(x, gathered, source=arrived)  # the all-gather
        y = dtensor.relayout(tf.einsum(equation, full, kernel), out_layout)

        def grad(dy):
            dy = dtensor.relayout(dy, out_layout)
            stacked = partial_einsum(
                ctx, f"{out},{ker}->{inp}", dy, kernel, letter, out_layout.sharding_specs,
                kernel_layout.sharding_specs,
            )
            dx = resolve_partial(ctx, stacked, arrives_as)
            dkernel = dtensor.relayout(tf.einsum(f"{inp},{out}->{ker}", full, dy), kernel_layout)
            return dx, dkernel

        return y, grad

    return product(x, kernel)


def reads_as(x: Any, dtype: tf.DType) -> tf.Tensor:
    """A variable's value as a tensor of ``dtype`` (Keras autocasts weights to the compute dtype)."""
    value = tf.convert_to_tensor(x)
    return value if value.dtype == dtype else tf.cast(value, dtype)
