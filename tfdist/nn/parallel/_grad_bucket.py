"""``GradBucket`` (torch.distributed.GradBucket): what a DDP communication hook is given."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = ["GradBucket"]


class GradBucket:
    """One parameter's gradients on every replica, for a DDP communication hook.

    torch's bucket holds one rank's flattened gradients; a tfdist program
    holds every replica's at once, so ``buffer()`` is the stacked
    ``[R, *shape]`` tensor whose row ``r`` (on data-parallel device ``r``)
    is replica ``r``'s gradient of the loss on its own rows (a mean-reduced
    loss: torch's per-rank gradient).  A hook returns the tensor each
    replica then uses, of the same shape (torch returns a future of it; TF
    ops are already asynchronous).  tfdist makes one bucket per parameter.

    Example (a hook that averages the replicas' gradients, torch's default)::

        def mean_hook(state, bucket):
            return tf.reduce_mean(bucket.buffer(), axis=0, keepdims=True) + tf.zeros_like(bucket.buffer())
    """

    def __init__(self, index: int, buffer: tf.Tensor, parameter: Any, is_last: bool, mesh: dtensor.Mesh,
                 dp: str) -> None:
        self._index, self._buffer, self._parameter, self._is_last = index, buffer, parameter, is_last
        self.mesh, self.dp = mesh, dp

    def index(self) -> int:
        """The bucket's position (the parameter's, in the module's trainable variables)."""
        return self._index

    def buffer(self) -> tf.Tensor:
        """The stacked per-replica gradients ``[R, *shape]``."""
        return self._buffer

    def set_buffer(self, buffer: tf.Tensor) -> None:
        """Replaces the buffer (a hook may write its result here and return it)."""
        self._buffer = buffer

    def gradients(self) -> list[tf.Tensor]:
        """The bucket's gradients: ``[buffer()]`` (one parameter per bucket)."""
        return [self._buffer]

    def parameters(self) -> list[Any]:
        """The bucket's parameters: the stacked replica variable."""
        return [self._parameter]

    def is_last(self) -> bool:
        """True for the last bucket of the backward (torch's hooks count iterations on it)."""
        return self._is_last
