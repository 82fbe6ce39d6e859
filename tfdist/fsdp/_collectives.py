"""FSDP's communication on TF DTensor: all-gather a parameter, reduce-scatter its gradient.

A parameter is stored sharded on one dim over the data-parallel mesh dim
(``dp``).  Around its layer's call it is all-gathered (``relayout`` to the
layout without ``dp``: one ``CollectiveGatherV2``).  Its gradient is a sum
over the batch, which is sharded on ``dp``: TF DTensor would compute it as a
local product plus an all-reduce of the whole gradient inside the op, then
slice -- twice the bytes of torch's reduce-scatter.  Here the batch dim is
split into ``[N, B/N]`` (``N`` on ``dp``, a local reshape) and kept as a
leading axis of the product: each device's own partial gradient, a stacked
``Partial``.  One all-to-all moves ``dp`` from that axis onto the shard dim
and a local sum finishes the reduce-scatter: the bytes of torch's.

Everything here is a TF op on TF DTensors (no loop over devices); the
functions take TF layouts and know nothing of Keras.
"""

from __future__ import annotations

import dataclasses
from typing import Callable
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.fsdp._grad_sync import GradientSync
from tfdist.tensor._redistribute import reduce_scatter_move, relayout

__all__ = [
    "ShardedParam", "gather", "gathered_with_sliced_grad", "sharded_einsum", "sharded_lookup", "per_shard_call",
]

UNSHARDED = dtensor.UNSHARDED


@dataclasses.dataclass(frozen=True)
class ShardedParam:
    """How one parameter is stored and gathered.

    ``shard_layout`` holds it (``dp`` on ``dim``); ``full_layout`` is the
    same without ``dp`` (other mesh dims, e.g. tensor parallel, kept).
    ``dim`` is None for a parameter left replicated on ``dp`` (no dim
    divides evenly).  ``sync``: its group's gradient-sync switch (None:
    always reduced).
    """

    shard_layout: dtensor.Layout
    full_layout: dtensor.Layout
    dim: int | None
    dp: str
    sync: GradientSync | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def sharded(self) -> bool:
        return self.dim is not None


def gather(value: tf.Tensor, param: ShardedParam, dtype: tf.DType | None = None) -> tf.Tensor:
    """The all-gathered parameter (cast to ``dtype`` first: a low-precision gather moves fewer bytes)."""
    if dtype is not None and value.dtype != dtype:
        value = tf.cast(value, dtype)
    if not param.sharded:
        return value
    return relayout(value, param.full_layout, source=param.shard_layout)


def _scatter_grad(full_grad: tf.Tensor, param: ShardedParam, dtype: tf.DType) -> tf.Tensor:
    """A replicated (on dp) gradient -> the shard's: a local slice."""
    grad = dtensor.relayout(tf.cast(full_grad, dtype), param.full_layout)
    grad = grad if not param.sharded else relayout(grad, param.shard_layout, source=param.full_layout)
    if param.sync is None:
        return grad
    total = param.sync.hold_or_release((id(param), "slice"), grad, param.shard_layout)
    return _zero_grad(param, grad.shape, dtype) if total is None else total


def _zero_grad(param: ShardedParam, shape: tf.TensorShape, dtype: tf.DType) -> tf.Tensor:
    """The gradient of a parameter whose reduction is held back (sync off)."""
    return dtensor.call_with_layout(tf.zeros, param.shard_layout, shape=shape, dtype=dtype)


def gathered_with_sliced_grad(
    value: tf.Tensor, param: ShardedParam, dtype: tf.DType | None, after: tf.Tensor | None,
) -> tf.Tensor:
    """All-gather for a layer FSDP cannot see inside: its gradient (already summed over the
    batch by TF inside the consuming op) comes back as the local slice.

    ``after``: the layer's input; the gather waits for it, so a layer's full
    parameters are made just before its use, not all at the start of the step.
    """

    @tf.custom_gradient
    def gathered(value):
        deps = [after] if after is not None and tf.inside_function() else []
        with tf.control_dependencies(deps):
            full = gather(value, param, dtype)

        def grad(dfull):
            return _scatter_grad(dfull, param, value.dtype)

        return full, grad

    return gathered(value)


def _split_batch(x: tf.Tensor, specs: list[str], parts: int, mesh: dtensor.Mesh) -> tf.Tensor:
    """Dim 0 (sharded on dp) -> ``[parts, B/parts]``, the first sharded: a local reshape."""
    shape = tf.unstack(tf.shape(x)) if None in x.shape.as_list() else x.shape.as_list()
    new_shape = [parts, shape[0] // parts] + list(shape[1:])
    return dtensor.relayout(tf.reshape(x, new_shape), dtensor.Layout([specs[0], UNSHARDED] + specs[1:], mesh))


def _reduce_scatter_stacked(
    stacked: tf.Tensor, stacked_specs: list[str], param: ShardedParam, dtype: tf.DType,
) -> tf.Tensor:
    """A stacked Partial ``[N(dp), *shape]`` -> the parameter's shard (sum over dp); with the
    group's gradient sync off, held unreduced instead (a zero gradient)."""
    mesh = param.shard_layout.mesh
    if param.sync is not None:
        held = param.sync.hold_or_release((id(param), "stacked"), stacked, dtensor.Layout(stacked_specs, mesh))
        if held is None:
            return _zero_grad(param, stacked.shape[1:], dtype)
        stacked = held
    if param.sharded:
        moved, _ = reduce_scatter_move(stacked, stacked_specs, 0, param.dim + 1, mesh)  # the all-to-all
        total = tf.reduce_sum(moved, axis=0)
    else:
        total = tf.reduce_sum(stacked, axis=0)  # a parameter kept whole: TF all-reduces it
    return dtensor.relayout(tf.cast(total, dtype), param.shard_layout)


def _letter_specs(letters: str, sources: list[tuple[str, list[str]]], batch: str | None, dp: str) -> list[str]:
    """The sharding spec of each einsum letter: dp for the batch letter, else the parameter's."""
    out = []
    for c in letters:
        spec = dp if c == batch else UNSHARDED
        if c != batch:
            for names, specs in sources:
                if c in names:
                    spec = specs[names.index(c)]
                    break
        out.append(spec)
    return out


def sharded_einsum(
    equation: str,
    x: tf.Tensor,
    kernel: tf.Tensor,
    param: ShardedParam,
    *,
    batch_sharded: bool,
    compute_dtype: tf.DType | None,
    reduce_dtype: tf.DType | None,
    regather: "Callable[[], tf.Tensor] | None",
    bias: tuple[tf.Tensor, ShardedParam, str] | None = None,
) -> tf.Tensor:
    """``einsum(equation, x, all_gather(kernel)) (+ all_gather(bias))`` with FSDP's backward.

    ``x``'s dim 0 is the batch (sharded on dp when ``batch_sharded``).
    Backward: the input gradient uses the full kernel, all-gathered again
    from ``regather()`` (a fresh read of the variable) when given -- the
    forward copy is then not kept alive; a second gather of the same tensor
    would be merged with the first by TF's common-subexpression
    elimination, a fresh read is not.  The
    kernel (and bias) gradient is the stacked per-device partial product,
    reduce-scattered onto the shard in ``reduce_dtype``.  ``bias`` is
    ``(value, param, letters)``: its letters are a suffix of the output's.

    Example: a Dense kernel ``[K, N]`` sharded on dim 0 over 8 devices::

        y = sharded_einsum("bk,kn->bn", x, kernel, param, batch_sharded=True, ...)
    """
    lhs, out = equation.split("->")
    inp, ker = lhs.split(",")
    batch = inp[0]
    mesh, dp = param.shard_layout.mesh, param.dp
    parts = mesh.dim_size(dp)
    full_specs = list(param.full_layout.sharding_specs)
    sources = [(ker, full_specs)]
    if bias is not None:
        sources.append((bias[2], list(bias[1].full_layout.sharding_specs)))
    b = batch if batch_sharded else None
    x_specs, y_specs = _letter_specs(inp, sources, b, dp), _letter_specs(out, sources, b, dp)
    x_layout, y_layout = dtensor.Layout(x_specs, mesh), dtensor.Layout(y_specs, mesh)
    dtype = compute_dtype or x.dtype
    x = tf.cast(x, dtype)
    t = next(c for c in "tzyxwvuqponmlkjihgfedcba" if c not in equation)
    split_inp, split_out = inp.replace(batch, t + batch), out.replace(batch, t + batch)
    stacked_specs = [dp] + full_specs

    def full_bias(value):
        return gather(value, bias[1], dtype)

    @tf.custom_gradient
    def product(x, kernel, *bias_value):
        # relayouted inside: TF's own gradient of a relayout (RelayoutLike) mis-propagates
        # layouts (docs/tf_dtensor_repros/rowwise_sequence_shard_output.py)
        x = dtensor.relayout(x, x_layout)
        with tf.control_dependencies([x] if tf.inside_function() else []):
            full = gather(kernel, param, dtype)
        y = tf.einsum(equation, x, full)
        if bias is not None:
            y = y + full_bias(bias_value[0])
        y = dtensor.relayout(y, y_layout)

        def grad(dy):
            dy = dtensor.relayout(tf.cast(dy, dtype), y_layout)
            if regather is not None and param.sharded:
                again = gather(_tied_to(regather(), dy, param, y_specs, parts, batch_sharded), param, dtype)
            else:
                again = full
            dx = dtensor.relayout(tf.einsum(f"{out},{ker}->{inp}", dy, again), x_layout)
            rdtype = reduce_dtype or dtype
            grads = [dx]
            if batch_sharded:
                xs = _split_batch(tf.cast(x, rdtype), x_specs, parts, mesh)
                dys = _split_batch(tf.cast(dy, rdtype), y_specs, parts, mesh)
                stacked = dtensor.relayout(
                    tf.einsum(f"{split_inp},{split_out}->{t}{ker}", xs, dys), dtensor.Layout(stacked_specs, mesh)
                )
                grads.append(_reduce_scatter_stacked(stacked, stacked_specs, param, kernel.dtype))
            else:  # every device holds the whole batch: the product is whole, the shard a slice
                grads.append(_scatter_grad(tf.einsum(f"{inp},{out}->{ker}", x, dy), param, kernel.dtype))
            if bias is not None:
                grads.append(_bias_grad(dy, out, bias, batch_sharded, y_specs, parts, rdtype, t))
            return tuple(grads)

        return y, grad

    args = (x, kernel) + ((bias[0],) if bias is not None else ())
    return product(*args)


def _tied_to(
    shard: tf.Tensor, dy: tf.Tensor, param: ShardedParam, dy_specs: list[str], parts: int, batch_sharded: bool,
) -> tf.Tensor:
    """``shard`` plus zeros computed from ``dy``: the backward's all-gather then waits for the
    gradient and is not merged with the forward's (TF's MLIR CSE merges two reads of a variable
    with no write between, and then the two gathers) -- so the forward copy can be freed.
    No communication: each device zeroes its own rows of ``dy``."""
    mesh, d = param.shard_layout.mesh, param.dim
    if batch_sharded:
        dys = _split_batch(dy, dy_specs, parts, mesh)
        own = tf.reduce_sum(dys, axis=list(range(1, dys.shape.rank)))  # [N] on dp, local
        size = shard.shape[d]
        zeros = tf.reshape(tf.broadcast_to(tf.reshape(own * 0, [parts, 1]), [parts, size // parts]), [size])
        zeros = dtensor.relayout(zeros, dtensor.Layout([param.dp], mesh))
        shape = [1] * shard.shape.rank
        shape[d] = size
        zeros = tf.reshape(zeros, shape)
    else:
        zeros = tf.reduce_sum(dy) * 0
    return shard + tf.cast(zeros, shard.dtype)


def _bias_grad(
    dy: tf.Tensor, out: str, bias: tuple[tf.Tensor, ShardedParam, str], batch_sharded: bool,
    y_specs: list[str], parts: int, rdtype: tf.DType, t: str,
) -> tf.Tensor:
    """The bias gradient: ``dy`` summed over the dims the bias broadcasts over.

    The bias' letters are a suffix of the output's; a letter whose bias dim
    is 1 (Keras EinsumDense's broadcast dims) is summed with keepdims.
    """
    value, param, letters = bias
    mesh = param.shard_layout.mesh
    ones = [i for i, n in enumerate(value.shape) if n == 1 and param.full_layout.sharding_specs[i] == UNSHARDED]
    if not batch_sharded:
        total = tf.einsum(f"{out}->{letters}", tf.cast(dy, rdtype))
        if ones:
            total = tf.reduce_sum(total, axis=ones, keepdims=True)
        return _scatter_grad(total, param, value.dtype)
    batch = out[0]
    dys = _split_batch(tf.cast(dy, rdtype), y_specs, parts, mesh)
    stacked = tf.einsum(f"{out.replace(batch, t + batch)}->{t}{letters}", dys)
    if ones:
        stacked = tf.reduce_sum(stacked, axis=[1 + i for i in ones], keepdims=True)
    specs = [param.dp] + list(param.full_layout.sharding_specs)
    stacked = dtensor.relayout(stacked, dtensor.Layout(specs, mesh))
    return _reduce_scatter_stacked(stacked, specs, param, value.dtype)


def sharded_lookup(
    ids: tf.Tensor, table: tf.Tensor, param: ShardedParam, *, batch_sharded: bool,
    compute_dtype: tf.DType | None, reduce_dtype: tf.DType | None,
) -> tf.Tensor:
    """Rows of the all-gathered ``table`` ``[V, D]`` for ``ids`` (batch on dp), FSDP's backward.

    TF's gradient of the gather sums the rows over the batch shards with an
    all-reduce of the whole ``[V, D]`` table.  Here each device's own rows
    are a product with its one-hot ids (``[k, V]`` for its ``k`` ids,
    backward only): a stacked ``[N, V, D]`` Partial, reduce-scattered onto the
    shard.  The backward does not need the table, so the forward's gathered
    copy is freed after the lookup.
    """
    mesh, dp = param.shard_layout.mesh, param.dp
    parts = mesh.dim_size(dp)
    rank = ids.shape.rank
    ids_specs = [dp if batch_sharded else UNSHARDED] + [UNSHARDED] * (rank - 1)
    ids = dtensor.relayout(tf.cast(ids, tf.int32), dtensor.Layout(ids_specs, mesh))
    table_specs = list(param.full_layout.sharding_specs)
    out_specs = ids_specs + table_specs[1:]
    dtype = compute_dtype or table.dtype
    vocab = int(table.shape[0])
    lead = "abcefghijlmnopqrsuwxyz"[:rank]

    @tf.custom_gradient
    def lookup(table):
        with tf.control_dependencies([ids] if tf.inside_function() else []):
            full = gather(table, param, dtype)
        y = dtensor.relayout(tf.gather(full, ids), dtensor.Layout(out_specs, mesh))

        def grad(dy):
            rdtype = reduce_dtype or dtype
            dy = dtensor.relayout(tf.cast(dy, rdtype), dtensor.Layout(out_specs, mesh))
            if not batch_sharded:
                one_hot = tf.one_hot(ids, vocab, dtype=rdtype)
                return _scatter_grad(tf.einsum(f"{lead}v,{lead}d->vd", one_hot, dy), param, table.dtype)
            ids_s = _split_batch(ids, ids_specs, parts, mesh)
            dys = _split_batch(dy, out_specs, parts, mesh)
            one_hot = dtensor.relayout(
                tf.one_hot(ids_s, vocab, dtype=rdtype), dtensor.Layout([dp] + [UNSHARDED] * (rank + 1), mesh)
            )
            split = "t" + lead
            stacked_specs = [dp] + table_specs
            stacked = dtensor.relayout(
                tf.einsum(f"{split}v,{split}d->tvd", one_hot, dys), dtensor.Layout(stacked_specs, mesh)
            )
            return _reduce_scatter_stacked(stacked, stacked_specs, param, table.dtype)

        return y, grad

    return lookup(table)


def _merge_batch(xs: tf.Tensor, specs: list[str], mesh: dtensor.Mesh) -> tf.Tensor:
    """``[parts, B/parts, ...]`` -> ``[B, ...]`` (the inverse of ``_split_batch``): local."""
    shape = tf.unstack(tf.shape(xs)) if None in xs.shape.as_list() else xs.shape.as_list()
    return dtensor.relayout(tf.reshape(xs, [shape[0] * shape[1]] + list(shape[2:])), dtensor.Layout(specs, mesh))


def per_shard_call(
    fn: Callable[[tf.Tensor, list[tf.Tensor]], tf.Tensor], x: tf.Tensor, shards: list[tf.Tensor],
    params: list[ShardedParam], *, dtype: tf.DType | None, reduce_dtype: tf.DType | None,
) -> tf.Tensor:
    """``fn`` run on each data-parallel shard of the batch, as torch's FSDP ranks run a module.

    ``fn(x_i, fulls)`` gets one device's rows ``x_i`` (``[B/N, ...]``) and
    the all-gathered parameters.  It runs vectorised over the ``N`` shards
    (``tf.vectorized_map`` over ``x`` split to ``[N(dp), B/N, ...]``; the
    parameters broadcast to ``[N(dp), *full]``, one copy per device, a local
    op), so each device computes its own rows and each weight gradient comes
    out as the stacked per-device partial, reduce-scattered onto the shard
    in ``reduce_dtype`` (all-to-all + local sum: torch's bytes) where TF's
    own gradient would all-reduce it.  The backward uses the forward's
    activations (no recomputation).  The output must be one tensor whose
    dim 0 is the rows.  A layer that mixes rows (batch statistics) sees its
    shard's rows only, as under torch.  Raises ``ValueError`` when ``fn``
    has an op TF cannot vectorise or its output is not row-wise: the caller
    then takes the gathered route.

    Example: a custom layer ``y = x @ w + b`` with ``w`` sharded on dp::

        y = per_shard_call(lambda x, ws: x @ ws[0] + ws[1], x, [w, b], [pw, pb], dtype=None, reduce_dtype=None)
    """
    param0 = params[0]
    mesh, dp = param0.shard_layout.mesh, param0.dp
    parts = mesh.dim_size(dp)
    x_specs = [dp] + [UNSHARDED] * (x.shape.rank - 1)
    rows = x.shape[0] // parts if x.shape[0] is not None else None
    stacked_specs = [[dp] + list(p.full_layout.sharding_specs) for p in params]

    def one_shard(args):
        y = fn(args[0], list(args[1:]))
        if not isinstance(y, tf.Tensor) or y.shape.rank in (None, 0) or (
                rows is not None and y.shape[0] is not None and y.shape[0] != rows):
            raise ValueError(f"per_shard_call: the output is not one row-wise tensor (rows {rows}): {y!r}")
        return y

    # every relayout sits inside: TF's own gradient of a relayout (RelayoutLike) mis-propagates
    # layouts (docs/tf_dtensor_repros/rowwise_sequence_shard_output.py); the backward relayouts itself
    @tf.custom_gradient
    def run(x, *shards):
        x = dtensor.relayout(x, dtensor.Layout(x_specs, mesh))
        with tf.control_dependencies([x] if tf.inside_function() else []):
            fulls = [gather(s, p, dtype) for s, p in zip(shards, params)]
        copies = [dtensor.relayout(tf.broadcast_to(tf.expand_dims(f, 0), [parts] + f.shape.as_list()),
                                   dtensor.Layout(specs, mesh)) for f, specs in zip(fulls, stacked_specs)]
        xs = _split_batch(x, x_specs, parts, mesh)
        with tf.GradientTape() as tape:
            tape.watch([xs] + copies)
            ys = tf.vectorized_map(one_shard, (xs, *copies), fallback_to_while_loop=False)
        y_specs = [dp] + [UNSHARDED] * (ys.shape.rank - 2)
        y = _merge_batch(ys, y_specs, mesh)

        def grad(dy):
            dys = _split_batch(dtensor.relayout(tf.cast(dy, y.dtype), dtensor.Layout(y_specs, mesh)), y_specs, parts,
                               mesh)
            grads = tape.gradient(ys, [xs] + copies, output_gradients=dys)
            dx = None if grads[0] is None else _merge_batch(tf.convert_to_tensor(grads[0]), x_specs, mesh)  # ids: none
            dws = []
            for g, p, s, specs in zip(grads[1:], params, shards, stacked_specs):
                if g is None:  # a weight this call does not use (an untied embedding's other table)
                    dws.append(None)
                    continue
                g = tf.convert_to_tensor(g)  # a lookup's IndexedSlices: dense, the copy's shape
                g = dtensor.relayout(tf.cast(g, reduce_dtype or g.dtype), dtensor.Layout(specs, mesh))
                dws.append(_reduce_scatter_stacked(g, specs, p, s.dtype))
            return (dx,) + tuple(dws)

        return y, grad

    return run(x, *shards)
