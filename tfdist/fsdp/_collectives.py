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
import threading
from typing import Callable
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.fsdp._gather_order import GatherOrder
from tfdist.fsdp._grad_sync import GradientSync
from tfdist.tensor import _step_checks
from tfdist.tensor._per_device import per_device_call
from tfdist.tensor._per_device import split_batch as _split_batch
from tfdist.tensor._redistribute import reduce_scatter_move, relayout, relayout_traced

__all__ = [
    "ShardedParam", "gather", "gathered_with_sliced_grad", "sharded_einsum", "sharded_lookup", "per_shard_call",
    "reduce_scatter_in_hook",
]

UNSHARDED = dtensor.UNSHARDED


@dataclasses.dataclass(frozen=True)
class ShardedParam:
    """How one parameter is stored and gathered.

    ``shard_layout`` holds it (``dp`` on ``dim``); ``full_layout`` is the
    same without ``dp`` (other mesh dims, e.g. tensor parallel, kept).
    ``dim`` is None for a parameter left replicated on ``dp`` (no dim
    divides evenly).  ``sync``: its group's gradient-sync switch (None:
    always reduced); ``order``: when its group's gathers may start (None:
    each waits for its layer).
    """

    shard_layout: dtensor.Layout
    full_layout: dtensor.Layout
    dim: int | None
    dp: str
    sync: GradientSync | None = dataclasses.field(default=None, compare=False, repr=False)
    order: GatherOrder | None = dataclasses.field(default=None, compare=False, repr=False)

    def forward_wait(self, own: tf.Tensor) -> list[tf.Tensor]:
        """Control inputs of this parameter's forward gather: its layer's input ``own``, or what a
        prefetching group set (``GatherOrder``); nothing outside a traced step."""
        if self.order is not None:
            return self.order.forward_wait(own)
        return [own] if tf.inside_function() else []

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
        return _published_reduced(grad, param)
    total = param.sync.hold_or_release((id(param), "slice"), grad, param.shard_layout)
    return _zero_grad(param, grad.shape, dtype) if total is None else _published_reduced(total, param)


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
        deps = param.forward_wait(after) if after is not None else []
        with tf.control_dependencies(deps):
            full = gather(value, param, dtype)

        def grad(dfull):
            return _scatter_grad(dfull, param, value.dtype)

        return full, grad

    return gathered(value)


def _reduce_scatter_stacked(
    stacked: tf.Tensor, stacked_specs: list[str], param: ShardedParam, dtype: tf.DType,
) -> tf.Tensor:
    """A stacked Partial ``[N(dp), *shape]`` -> the parameter's shard (sum over dp); with the
    group's gradient sync off, held unreduced instead (a zero gradient); with an FSDP1 comm hook,
    reduced by the hook."""
    mesh = param.shard_layout.mesh
    if param.sync is not None:
        held = param.sync.hold_or_release((id(param), "stacked"), stacked, dtensor.Layout(stacked_specs, mesh))
        if held is None:
            return _zero_grad(param, stacked.shape[1:], dtype)
        stacked = held
        if param.sync.comm_hook is not None:
            return _published_reduced(_through_comm_hook(stacked, stacked_specs, param, dtype), param)
    return _published_reduced(_sum_scatter(stacked, stacked_specs, param, dtype), param)


def _sum_scatter(stacked: tf.Tensor, stacked_specs: list[str], param: ShardedParam, dtype: tf.DType) -> tf.Tensor:
    """FSDP's reduction of a stacked Partial: all-to-all onto the shard dim + a local sum."""
    mesh = param.shard_layout.mesh
    if param.sharded:
        moved, _ = reduce_scatter_move(stacked, stacked_specs, 0, param.dim + 1, mesh)  # the all-to-all
        total = tf.reduce_sum(moved, axis=0)
    else:
        total = tf.reduce_sum(stacked, axis=0)  # a parameter kept whole: TF all-reduces it
    return dtensor.relayout(tf.cast(total, dtype), param.shard_layout)


_HOOKED = threading.local()  # the parameter whose gradient a comm hook is reducing


def _through_comm_hook(stacked: tf.Tensor, stacked_specs: list[str], param: ShardedParam, dtype: tf.DType,
                       ) -> tf.Tensor:
    state, hook = param.sync.comm_hook
    _HOOKED.current = (stacked_specs, param)
    try:
        out = tf.convert_to_tensor(hook(state, stacked))
    finally:
        _HOOKED.current = None
    if out.shape != stacked.shape[1:]:
        raise ValueError(f"register_comm_hook: the hook must return the reduced gradient, shape "
                         f"{stacked.shape[1:]} (the parameter's). Received: shape {out.shape}")
    return dtensor.relayout(tf.cast(out, dtype), param.shard_layout)  # replicated or the shard's: local


def reduce_scatter_in_hook(grad: tf.Tensor) -> tf.Tensor:
    """Inside an FSDP1 comm hook: FSDP's reduce-scatter of ``grad`` (the stacked per-device gradient
    the hook was given, maybe transformed: scaled, cast to float16), in ``grad``'s dtype.

    Example (a hook that halves the gradient before reducing it)::

        def halve(state, grad):
            return reduce_scatter_in_hook(grad * 0.5)
    """
    current = getattr(_HOOKED, "current", None)
    if current is None:
        raise RuntimeError("reduce_scatter_in_hook: call it inside an FSDP communication hook "
                           "(FullyShardedDataParallel.register_comm_hook).")
    stacked_specs, param = current
    return _sum_scatter(dtensor.relayout(grad, dtensor.Layout(stacked_specs, param.shard_layout.mesh)),
                        stacked_specs, param, grad.dtype)


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


def _relayout_operand(t: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """A product's operand, output or gradient relayouted: through a rank-3 view from rank 4 on
    (``relayout_traced``: TF's own move between inner dims of a rank-4 tensor is wrong), as TF
    does it below (the collectives torch's plan has; tests/fsdp count them)."""
    return relayout_traced(t, layout) if t.shape.rank is not None and t.shape.rank >= 4 else dtensor.relayout(t, layout)


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
        full = gather(value, bias[1], dtype)
        if len(out) < 4:
            return full
        # laid out as the output's dims it adds to, so the add moves nothing inside TF (TF's
        # own move of a mesh dim between two inner dims of the rank-4 output is wrong:
        # keras-hub Bert's value projection with its kernel and bias stored over ``batch``)
        return relayout_traced(full, dtensor.Layout([y_specs[out.index(c)] for c in bias[2]], mesh))

    @tf.custom_gradient
    def product(x, kernel, *bias_value):
        # relayouted inside: TF's own gradient of a relayout (RelayoutLike) mis-propagates
        # layouts (docs/tf_dtensor_repros/rowwise_sequence_shard_output.py)
        x = _relayout_operand(x, x_layout)
        with tf.control_dependencies(param.forward_wait(x)):
            full = gather(kernel, param, dtype)
        y = tf.einsum(equation, x, full)
        if len(out) >= 4:  # the output laid out before the bias joins it (full_bias)
            y = _relayout_operand(y, y_layout)
        if bias is not None:
            y = y + full_bias(bias_value[0])
        y = _relayout_operand(y, y_layout)

        def grad(dy):
            dy = _relayout_operand(tf.cast(dy, dtype), y_layout)
            _publish(param, lambda: _device_zeros(dy, y_specs, parts, mesh, batch_sharded), at="pre")
            if regather is not None and param.sharded:
                zeros = _device_zeros(dy, y_specs, parts, mesh, batch_sharded)
                tie = param.order.backward_tie(zeros) if param.order is not None else zeros
                again = gather(_tied_to(regather(), tie, param, parts), param, dtype)
            else:
                again = full
            dx = _relayout_operand(tf.einsum(f"{out},{ker}->{inp}", dy, again), x_layout)
            _publish(param, lambda: _device_zeros(dx, x_specs, parts, mesh, batch_sharded), at="post")
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


def _device_zeros(
    t: tf.Tensor, specs: list[str], parts: int, mesh: dtensor.Mesh, batch_sharded: bool,
) -> tf.Tensor:
    """Zeros computed from ``t``, no communication: ``[N]`` on dp (each device zeroes its own
    rows) when ``t``'s dim 0 is the batch sharded on dp, else a scalar."""
    if batch_sharded:
        ts = _split_batch(t, specs, parts, mesh)
        return tf.reduce_sum(ts, axis=list(range(1, ts.shape.rank))) * 0
    return tf.reduce_sum(t) * 0


def _publish(param: ShardedParam, zeros, *, at: str) -> None:
    """Tells the groups ``param``'s group prefetches in the backward that it has reached ``at``
    (``GatherOrder.backward_at``; ``zeros``: a tensor, or a function making it, run only when some
    group listens)."""
    order = param.order
    if order is None or not order.backward_targets or at != order.backward_at:
        return
    order.backward_publish(zeros() if callable(zeros) else zeros, at=at)


def _published_reduced(grad: tf.Tensor, param: ShardedParam) -> tf.Tensor:
    """``grad`` (a reduced gradient shard), after telling the groups ``param``'s group prefetches
    with ``backward_at="reduced"`` (FSDP1 without backward prefetch) that its reduction is done."""
    def zeros():
        if not param.sharded:
            return tf.reduce_sum(grad) * 0
        others = [d for d in range(grad.shape.rank) if d != param.dim]
        per_row = tf.reduce_sum(grad, axis=others) if others else grad  # the shard dim, on dp: local
        mesh, dp = param.shard_layout.mesh, param.dp
        return _device_zeros(per_row, [dp], mesh.dim_size(dp), mesh, True)

    _publish(param, zeros, at="reduced")
    return grad


def _tied_to(shard: tf.Tensor, zeros: tf.Tensor, param: ShardedParam, parts: int) -> tf.Tensor:
    """``shard`` plus ``zeros`` (from ``_device_zeros`` of the gradient the gather must wait
    for): the backward's all-gather then waits for it and is not merged with the forward's
    (TF's MLIR CSE merges two reads of a variable with no write between, and then the two
    gathers) -- so the forward copy can be freed.  No communication."""
    mesh, d = param.shard_layout.mesh, param.dim
    if zeros.shape.rank == 1:  # [N] on dp: each device's own zero, spread over its rows of the shard dim
        size = shard.shape[d]
        spread = tf.reshape(tf.broadcast_to(tf.reshape(zeros, [parts, 1]), [parts, size // parts]), [size])
        spread = dtensor.relayout(spread, dtensor.Layout([param.dp], mesh))
        shape = [1] * shard.shape.rank
        shape[d] = size
        zeros = tf.reshape(spread, shape)
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
    vocab = int(table.shape[0])
    ids = _step_checks.lookup_ids(ids, vocab, f"Embedding lookup: id {{value}} is not in [0, {vocab}).")
    ids = dtensor.relayout(ids, dtensor.Layout(ids_specs, mesh))
    table_specs = list(param.full_layout.sharding_specs)
    out_specs = ids_specs + table_specs[1:]
    dtype = compute_dtype or table.dtype
    lead = "abcefghijlmnopqrsuwxyz"[:rank]

    @tf.custom_gradient
    def lookup(table):
        with tf.control_dependencies(param.forward_wait(ids)):
            full = gather(table, param, dtype)
        y = dtensor.relayout(tf.gather(full, ids), dtensor.Layout(out_specs, mesh))

        def grad(dy):
            rdtype = reduce_dtype or dtype
            dy = dtensor.relayout(tf.cast(dy, rdtype), dtensor.Layout(out_specs, mesh))
            for at in ("pre", "post"):  # a lookup's backward has no input gradient to wait for
                _publish(param, lambda: _device_zeros(dy, out_specs, parts, mesh, batch_sharded), at=at)
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
    stacked_specs = [[dp] + list(p.full_layout.sharding_specs) for p in params]

    def rows(t):  # zeros from a tensor whose dim 0 is the rows on dp (prefetch triggers)
        return _device_zeros(t, [dp] + [UNSHARDED] * (t.shape.rank - 1), parts, mesh, True)

    def stack(x, shards):
        with tf.control_dependencies(param0.forward_wait(x)):
            fulls = [gather(s, p, dtype) for s, p in zip(shards, params)]
        return [dtensor.relayout(tf.broadcast_to(tf.expand_dims(f, 0), [parts] + f.shape.as_list()),
                                 dtensor.Layout(specs, mesh)) for f, specs in zip(fulls, stacked_specs)]

    def reduce_scatter(grads, dy, dx):
        _publish(param0, lambda: rows(dy), at="pre")
        _publish(param0, lambda: rows(dy if dx is None else dx), at="post")
        out = []
        for g, p, s, specs in zip(grads, params, shards, stacked_specs):
            if g is None:  # a weight this call does not use (an untied embedding's other table)
                out.append(None)
                continue
            g = dtensor.relayout(tf.cast(g, reduce_dtype or g.dtype), dtensor.Layout(specs, mesh))
            out.append(_reduce_scatter_stacked(g, specs, p, s.dtype))
        return out

    return per_device_call(fn, x, shards, mesh=mesh, dp=dp, stack=stack, unstack_grads=reduce_scatter)
