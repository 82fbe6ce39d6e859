"""Keras ops whose TF DTensor expansion fails, written in forms it expands.

Active only while a keras distribution is set (plain Keras keeps its own
code). Each function computes the same values as Keras' TF backend.

``top_k``'s gradient: TF's ``TopKV2`` gradient scatters the incoming
gradient with ``ScatterNd`` at flat indices computed from the *global*
shape, and TF DTensor expands it on the local shard of a batch-sharded
input, so the indices run past the shard ("indices[255] = [508] does not
index into shape [256]", keras-hub's Qwen-MoE router). The same gradient as
a one-hot product, ``sum_k one_hot(indices_k) * dvalues_k``, is elementwise
and a reduction, which TF DTensor lays out on any sharding.

``one_hot``: when layout propagation gives the one-hot's class dim a
sharding from its consumer (the router kernel sharded over ``model``),
TF DTensor's ``OneHot`` expansion keeps the global result type ("SPMD
expansion resulted in op output inconsistent with the provided layout.
Expected shape: <256,2,16> got shape: <128,2,4>"). The same values as a
comparison of the ids with a range of classes, ``ids[..., None] == range(n)``,
are elementwise ops TF DTensor expands on any sharding.

``stack``'s gradient: ``Pack``'s gradient is an ``Unpack``, and TF DTensor's
Unpack expansion reconciles only the unpacked dim of its input's layout with
its outputs' (``UnpackSPMDExpander::ExpandOp`` relayouts the input only
``if (input_layout->num_shards_for_dim(input_layout->dim(axis)) != 1)``);
where propagation gave the outputs another sharding of a different dim, the
local shapes disagree ("Expected shape: <16,8,16,4> got shape: <16,8,4,4>",
keras-hub's rotary embedding on heads sharded over ``model`` next to
key/value heads kept whole). Stacked as a concatenation of expanded tensors,
the gradient is a split, which TF DTensor expands with the relayouts it needs.

``slice_update``: Keras' TF backend writes a slice with
``XlaDynamicUpdateSlice``, for which TF DTensor has no layout propagation
("'tf.XlaDynamicUpdateSlice' op does not implement layout propagation",
keras-hub's key/value cache in ``generate``). The same values as a gather of
the update along each dim it is shorter on, kept where a position lies
inside the written window: a gather, comparisons and a select.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfdist import _patches

__all__ = ["install"]

_TOP_K = "keras.src.backend.tensorflow.math:top_k"
_ONE_HOT = "keras.src.backend.tensorflow.nn:one_hot"
_STACK = "keras.src.backend.tensorflow.numpy:stack"
_SLICE_UPDATE = "keras.src.backend.tensorflow.core:slice_update"


def slice_update_by_select(inputs: tf.Tensor, start_indices: Any, updates: tf.Tensor) -> tf.Tensor:
    """``inputs`` with ``updates`` written at ``start_indices`` (XLA's clamping of the start
    so the window fits, as ``dynamic_update_slice`` does)."""
    rank = inputs.shape.rank
    starts = tf.cast(tf.convert_to_tensor(start_indices), tf.int32)
    placed, inside = updates, None
    for d in range(rank):
        n, u = inputs.shape[d], updates.shape[d]
        if n == u:
            continue
        start = tf.clip_by_value(starts[d], 0, n - u)
        positions = tf.range(n, dtype=tf.int32)
        placed = tf.gather(placed, tf.clip_by_value(positions - start, 0, u - 1), axis=d)
        window = tf.logical_and(positions >= start, positions < start + u)
        window = tf.reshape(window, [n if i == d else 1 for i in range(rank)])
        inside = window if inside is None else tf.logical_and(inside, window)
    return placed if inside is None else tf.where(inside, placed, inputs)


def one_hot_by_comparison(ids: tf.Tensor, depth: int, axis: int = -1, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """``tf.one_hot(ids, depth, axis=axis, dtype=dtype)`` as ``ids == range(depth)`` (ids < 0 or
    >= depth give a zero row, as TF's)."""
    ids = tf.convert_to_tensor(ids)
    rank = ids.shape.rank + 1
    axis = axis % rank
    classes = tf.reshape(tf.range(depth, dtype=ids.dtype), [depth] + [1] * (rank - 1 - axis))
    return tf.cast(tf.equal(tf.expand_dims(ids, axis), classes), dtype)


def top_k_with_dense_gradient(x: tf.Tensor, k: int, sorted: bool = True) -> tuple[tf.Tensor, tf.Tensor]:
    """``tf.math.top_k`` whose values' gradient is a one-hot product (no ScatterNd)."""

    @tf.custom_gradient
    def values_of(x):
        values, indices = tf.math.top_k(x, k, sorted=sorted)

        def grad(dvalues):
            picked = one_hot_by_comparison(indices, x.shape[-1], dtype=dvalues.dtype)  # [..., k, n]
            return tf.reduce_sum(picked * tf.expand_dims(dvalues, -1), axis=-2)

        return values, grad

    x = tf.convert_to_tensor(x)
    values = values_of(x)
    _, indices = tf.math.top_k(tf.stop_gradient(x), k, sorted=sorted)
    return values, indices


def install() -> None:
    original = _patches.original(_TOP_K)

    def top_k(x, k, sorted=True):
        x_ = tf.convert_to_tensor(x)
        if keras.distribution.distribution() is None or not x_.dtype.is_floating or x_.shape[-1] is None:
            return original(x, k, sorted=sorted)
        return top_k_with_dense_gradient(x_, k, sorted=sorted)

    _patches.install(_TOP_K, top_k)
    original_one_hot = _patches.original(_ONE_HOT)

    def one_hot(x, num_classes, axis=-1, dtype=None, sparse=False):
        if keras.distribution.distribution() is None or sparse or dtype == "bool":
            return original_one_hot(x, num_classes, axis=axis, dtype=dtype, sparse=sparse)
        x = tf.convert_to_tensor(x)
        x = tf.cast(x, "int64") if not x.dtype.is_integer else x
        return one_hot_by_comparison(x, int(num_classes), axis=axis, dtype=dtype or "float32")

    _patches.install(_ONE_HOT, one_hot)
    original_stack = _patches.original(_STACK)

    def stack(x, axis=0):
        if keras.distribution.distribution() is None or tf.executing_eagerly():
            return original_stack(x, axis=axis)
        tensors = [tf.convert_to_tensor(t) for t in x]
        if len({t.dtype for t in tensors}) != 1 or any(t.shape.rank is None for t in tensors):
            return original_stack(x, axis=axis)
        axis = axis % (tensors[0].shape.rank + 1)
        return tf.concat([tf.expand_dims(t, axis) for t in tensors], axis=axis)

    _patches.install(_STACK, stack)
    original_slice_update = _patches.original(_SLICE_UPDATE)

    def slice_update(inputs, start_indices, updates):
        if keras.distribution.distribution() is None or tf.executing_eagerly():
            return original_slice_update(inputs, start_indices, updates)
        inputs, updates = tf.convert_to_tensor(inputs), tf.convert_to_tensor(updates)
        if not inputs.shape.is_fully_defined() or not updates.shape.is_fully_defined():
            return original_slice_update(inputs, start_indices, updates)
        return slice_update_by_select(inputs, start_indices, tf.cast(updates, inputs.dtype))

    _patches.install(_SLICE_UPDATE, slice_update)
