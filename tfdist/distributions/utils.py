"""Helpers shared by the distributions (torch.distributions.utils)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor._api import DTensor

__all__ = ["broadcast_all", "as_shape", "as_float_tensor"]


def as_shape(shape: Sequence[int] | int) -> tf.TensorShape:
    """A ``tf.TensorShape`` from an int, a sequence or a shape (torch accepts ``sample(5)``)."""
    if isinstance(shape, int):
        shape = (shape,)
    return tf.TensorShape(shape)


def _sum_rightmost(value: tf.Tensor, dims: int) -> tf.Tensor:
    """Sums the rightmost ``dims`` dims of ``value`` (none when ``dims <= 0``)."""
    return tf.reduce_sum(value, axis=list(range(-dims, 0))) if dims > 0 else value


def as_float_tensor(value: Any) -> tf.Tensor:
    """A tensor of ``value``: tensors and float numpy arrays keep their float dtype, the rest is float32
    (torch: tensors keep their dtype, Python numbers take the default)."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and tf.as_dtype(dtype).is_floating:
        return tf.convert_to_tensor(value, dtype=tf.as_dtype(dtype))
    return tf.convert_to_tensor(value, dtype=tf.float32)


def is_dtensor_value(v: Any) -> bool:
    """A TF DTensor (eager) or a tfdist DTensor."""
    if isinstance(v, DTensor):
        return True
    return isinstance(v, tf.Tensor) and tf.executing_eagerly() and dtensor.is_dtensor(v)


def onto_mesh_of(value: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """``value`` (an ordinary tensor) as a TF DTensor next to ``like``: replicated on its mesh, then
    laid out as ``like`` when the shapes agree (TF DTensor ops refuse ordinary tensors beside DTensors)."""
    layout = dtensor.fetch_layout(like)
    value = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(layout.mesh, value.shape.rank))
    if value.shape == like.shape and not layout.is_fully_replicated():
        value = dtensor.relayout(value, layout)
    return value


def broadcast_all(*values: Any, dtype=None) -> list[tf.Tensor]:
    """Converts and broadcasts parameters to one shape (torch's broadcast_all).

    tfdist DTensors become TF DTensors; Python numbers and ordinary tensors
    beside a DTensor are placed on its mesh (torch broadcasts them freely).
    """
    values = tuple(v.to_tf() if isinstance(v, DTensor) else v for v in values)
    # tensors, and numpy arrays of a float dtype, keep their dtype (torch: Python numbers take the
    # default dtype, tensors their own); Python numbers follow them
    tensors = [v for v in values if isinstance(v, (tf.Tensor, tf.Variable))
               or (isinstance(v, (np.ndarray, np.generic)) and np.issubdtype(v.dtype, np.floating))]
    if dtype is None:
        dtype = tf.as_dtype(tensors[0].dtype) if tensors else tf.float32
        if not dtype.is_floating:
            dtype = tf.float32
    converted = [tf.convert_to_tensor(v, dtype=dtype) if not isinstance(v, tf.Tensor) or v.dtype != dtype
                 else v for v in values]
    converted = [tf.cast(v, dtype) for v in converted]
    shape = tf.TensorShape(())
    for v in converted:
        shape = tf.broadcast_static_shape(shape, v.shape)
    anchor = next((v for v in converted if is_dtensor_value(v)), None)
    if anchor is None:
        return [tf.broadcast_to(v, shape) for v in converted]
    out = []
    for v in converted:
        if not is_dtensor_value(v):
            v = onto_mesh_of(tf.broadcast_to(v, shape), anchor)
        elif v.shape != shape:
            v = tf.broadcast_to(v, shape)
        out.append(v)
    return out
