"""Helpers shared by the distributions (torch.distributions.utils)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["broadcast_all", "as_shape"]


def as_shape(shape: Sequence[int] | int) -> tf.TensorShape:
    """A ``tf.TensorShape`` from an int, a sequence or a shape (torch accepts ``sample(5)``)."""
    if isinstance(shape, int):
        shape = (shape,)
    return tf.TensorShape(shape)


def _sum_rightmost(value: tf.Tensor, dims: int) -> tf.Tensor:
    """Sums the rightmost ``dims`` dims of ``value`` (none when ``dims <= 0``)."""
    return tf.reduce_sum(value, axis=list(range(-dims, 0))) if dims > 0 else value


def broadcast_all(*values: Any, dtype=None) -> list[tf.Tensor]:
    """Converts and broadcasts parameters to one shape (torch's broadcast_all)."""
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
    return [tf.broadcast_to(v, shape) for v in converted]
