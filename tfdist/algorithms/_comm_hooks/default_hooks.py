"""FSDP1's default communication hooks (torch.distributed.algorithms._comm_hooks.default_hooks).

An FSDP hook is called as ``hook(state, grad)`` for each gradient FSDP
reduces: ``grad`` is the stacked per-device gradient ``[N(dp), *shape]``
(row ``i`` device ``i``'s unreduced gradient: torch's per-rank unsharded
gradient), and the hook returns the reduced gradient of the parameter's
shape.  ``reduce_scatter_in_hook`` is FSDP's own reduction, for hooks that
transform the gradient first.  torch's hooks divide by the world size
because each rank's loss is its local mean; tfdist's gradient is already
that of the global loss, so nothing is divided.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.fsdp._collectives import reduce_scatter_in_hook

__all__ = ["DefaultState", "LowPrecisionState", "allreduce_hook", "reduce_scatter_hook", "fp16_compress_hook",
           "bf16_compress_hook", "reduce_scatter_in_hook"]


class DefaultState:
    """State for the default hooks: ``process_group`` must be None (the module's data-parallel mesh dim)."""

    def __init__(self, process_group: Any = None) -> None:
        if process_group is not None:
            raise ValueError("DefaultState: process_group must be None in tfdist (the FSDP mesh's data-parallel "
                             f"dim). Received: process_group={process_group!r}")
        self.process_group = process_group


class LowPrecisionState(DefaultState):
    """State for the compressing hooks (torch's ``parameter_type`` and ``precision``; tfdist's hooks
    choose the precision by their name)."""

    def __init__(self, process_group: Any = None, parameter_type: Any = tf.float32, precision: Any = tf.float16,
                 ) -> None:
        super().__init__(process_group)
        self.parameter_type, self.precision = parameter_type, precision


def allreduce_hook(state: Any, grad: tf.Tensor) -> tf.Tensor:
    """The gradient summed over the devices, whole on each (an all-reduce: NO_SHARD's reduction; for
    a sharded parameter each device then keeps its slice -- twice reduce-scatter's bytes)."""
    return tf.reduce_sum(grad, axis=0)


def reduce_scatter_hook(state: Any, grad: tf.Tensor, output: Any = None) -> tf.Tensor:
    """FSDP's own reduction: the reduce-scatter onto the shard (``output`` is accepted for torch's
    signature; TF returns the result).

    Example::

        model.register_comm_hook(DefaultState(), reduce_scatter_hook)
    """
    return reduce_scatter_in_hook(grad)


def _compressed(grad: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.cast(reduce_scatter_in_hook(tf.cast(grad, dtype)), grad.dtype)


def fp16_compress_hook(state: Any, grad: tf.Tensor, output: Any = None) -> tf.Tensor:
    """The reduce-scatter in float16 (half the bytes), cast back to the gradient's dtype."""
    return _compressed(grad, tf.float16)


def bf16_compress_hook(state: Any, grad: tf.Tensor, output: Any = None) -> tf.Tensor:
    """The reduce-scatter in bfloat16 (half the bytes), cast back to the gradient's dtype."""
    return _compressed(grad, tf.bfloat16)
