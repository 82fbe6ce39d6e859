"""A computation run on each device's rows, with each device's own weights: TF's vectoriser over
a stacked device axis.

torch's data-parallel ranks (FSDP, DDP) each run the module on their rows
with their own copy of the weights; the gradient a rank gets is its own.
On TF DTensor one SPMD program stands for all of them: the batch ``[B, ...]``
(dim 0 on the data-parallel mesh dim ``dp``) is split to ``[N(dp), B/N, ...]``
(a local reshape), each weight is given as a stacked ``[N(dp), *shape]``
(row ``i`` on device ``i``), and ``tf.vectorized_map`` runs the computation
over the leading axis -- every op then has that axis sharded on ``dp`` and
runs locally.  The weight gradients come out stacked the same way: each
device's own, with no communication; the caller decides what to do with
them (FSDP reduce-scatters them, DDP hands them to its comm hook).
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = ["split_batch", "merge_batch", "per_device_call"]

UNSHARDED = dtensor.UNSHARDED


def split_batch(x: tf.Tensor, specs: list[str], parts: int, mesh: dtensor.Mesh) -> tf.Tensor:
    """Dim 0 (sharded on dp) -> ``[parts, B/parts]``, the first sharded: a local reshape."""
    shape = tf.unstack(tf.shape(x)) if None in x.shape.as_list() else x.shape.as_list()
    new_shape = [parts, shape[0] // parts] + list(shape[1:])
    return dtensor.relayout(tf.reshape(x, new_shape), dtensor.Layout([specs[0], UNSHARDED] + specs[1:], mesh))


def merge_batch(xs: tf.Tensor, specs: list[str], mesh: dtensor.Mesh) -> tf.Tensor:
    """``[parts, B/parts, ...]`` -> ``[B, ...]`` (the inverse of ``split_batch``): local."""
    shape = tf.unstack(tf.shape(xs)) if None in xs.shape.as_list() else xs.shape.as_list()
    return dtensor.relayout(tf.reshape(xs, [shape[0] * shape[1]] + list(shape[2:])), dtensor.Layout(specs, mesh))


def per_device_call(
    fn: Callable[[Any, list[tf.Tensor]], tf.Tensor],
    x: Any,
    inputs: list[tf.Tensor],
    *,
    mesh: dtensor.Mesh,
    dp: str,
    stack: Callable[[Any, list[tf.Tensor]], list[tf.Tensor]],
    unstack_grads: Callable[[list[tf.Tensor | None], tf.Tensor, Any], list[tf.Tensor | None]],
) -> tf.Tensor:
    """``fn(x_i, weights_i)`` on each device's rows ``x_i`` (``[B/N, ...]``), vectorised.

    ``x`` is a tensor or a nest of them (a dict of a model's inputs), each
    with the batch in dim 0; ``fn`` gets each device's rows in the same
    structure.  ``stack(x, inputs)`` turns the weight inputs into stacked
    per-device values ``[N(dp), *shape]`` (FSDP: gather + one copy per
    device; DDP: the replicas as they are), after ``x`` is laid out.  In the
    backward, ``unstack_grads(stacked_grads, dy, dx)`` turns their gradients
    (stacked the same way, ``None`` for a weight ``fn`` does not use) into
    the inputs' (FSDP: reduce-scatter; DDP: the comm hook).  The backward
    uses the forward's activations (no recomputation).  ``fn``'s output must
    be one tensor whose dim 0 is the rows; otherwise, or when ``fn`` has an
    op TF cannot vectorise, raises ``ValueError``.

    Example: replicas ``w`` of shape ``[N, K, M]`` (row i on device i), each applied to its rows::

        y = per_device_call(lambda x, ws: x @ ws[0], x, [w], mesh=mesh, dp="dp",
                            stack=lambda x, ins: ins, unstack_grads=lambda gs, dy, dx: gs)
    """
    parts = mesh.dim_size(dp)
    leaves = tf.nest.flatten(x)
    n_x = len(leaves)
    leaf_specs = [[dp] + [UNSHARDED] * (leaf.shape.rank - 1) for leaf in leaves]
    rows = leaves[0].shape[0] // parts if leaves[0].shape[0] is not None else None
    # integer inputs (token ids, masks) have no gradient to ask for
    floating = [i for i, leaf in enumerate(leaves) if leaf.dtype.is_floating or leaf.dtype.is_complex]

    def one_device(args):
        y = fn(tf.nest.pack_sequence_as(x, list(args[:n_x])), list(args[n_x:]))
        if not isinstance(y, tf.Tensor) or y.shape.rank in (None, 0) or (
                rows is not None and y.shape[0] is not None and y.shape[0] != rows):
            raise ValueError(f"per_device_call: the output is not one row-wise tensor (rows {rows}): {y!r}")
        return y

    # every relayout sits inside: TF's own gradient of a relayout (RelayoutLike) mis-propagates
    # layouts (docs/tf_dtensor_repros/rowwise_sequence_shard_output.py); the backward relayouts itself
    @tf.custom_gradient
    def run(*args):
        laid = [dtensor.relayout(leaf, dtensor.Layout(specs, mesh)) for leaf, specs in zip(args[:n_x], leaf_specs)]
        stacked = stack(tf.nest.pack_sequence_as(x, laid), list(args[n_x:]))
        xs = [split_batch(leaf, specs, parts, mesh) for leaf, specs in zip(laid, leaf_specs)]
        with tf.GradientTape() as tape:
            tape.watch([xs[i] for i in floating] + stacked)
            ys = tf.vectorized_map(one_device, (*xs, *stacked), fallback_to_while_loop=False)
        y_specs = [dp] + [UNSHARDED] * (ys.shape.rank - 2)
        y = merge_batch(ys, y_specs, mesh)

        def grad(dy):
            dy = dtensor.relayout(tf.cast(dy, y.dtype), dtensor.Layout(y_specs, mesh))
            grads = tape.gradient(ys, [xs[i] for i in floating] + stacked,
                                  output_gradients=split_batch(dy, y_specs, parts, mesh))
            dxs: list = [None] * n_x
            for i, g in zip(floating, grads):  # a lookup's ids get none
                dxs[i] = None if g is None else merge_batch(tf.convert_to_tensor(g), leaf_specs[i], mesh)
            weight_grads = [None if g is None else tf.convert_to_tensor(g) for g in grads[len(floating):]]
            dx = dxs[0] if n_x == 1 else tf.nest.pack_sequence_as(x, dxs)
            return tuple(dxs) + tuple(unstack_grads(weight_grads, dy, dx))

        return y, grad

    return run(*leaves, *inputs)
