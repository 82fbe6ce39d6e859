"""``set_requires_gradient_sync(False)`` / FSDP1 ``no_sync()``: gradients held back unreduced.

torch's FSDP, with gradient sync off, skips the reduce-scatter and keeps
each rank's unsharded gradient; the next synchronized backward adds its own
and reduce-scatters the sum once.  tfdist holds a gradient in the form it
has just before its reduction: the stacked per-device partial
``[N(dp), *full]`` of FSDP's reduce-scatter routes (each device keeps its
own full-size partial, as each torch rank does -- no communication), or the
local slice of a gradient TF already reduced inside the consuming op (the
gathered route of a layer FSDP cannot see inside: its all-reduce is TF's
and is not skipped).  The parameter's gradient is then zero.  The next
synchronized backward adds the held sum before its reduction and clears it.

The switch is read when the backward is built: an eager step sees each
change; a ``tf.function`` step keeps the setting it was traced with (pass
the flag as a Python argument, so each setting gets its own trace).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.fsdp._replica_groups import in_replica_group

__all__ = ["GradientSync"]


class GradientSync:
    """How one FSDP group reduces its gradients: the gradient-sync switch, the gradients it holds,
    and an FSDP1 communication hook (``(state, hook)``, None: FSDP's own reduce-scatter).

    Example (what FSDP's reduction does with a gradient ``g`` laid out ``layout``)::

        sync = GradientSync()
        sync.enabled = False
        sync.hold_or_release(key, g, layout)   # None: held, nothing reduced
        sync.enabled = True
        total = sync.hold_or_release(key, g, layout)   # g + the held sum, to reduce now
    """

    def __init__(self) -> None:
        self.enabled = True
        self._held: dict[Hashable, tf.Variable] = {}
        self.comm_hook: tuple[Any, Callable[..., tf.Tensor]] | None = None

    def hold_or_release(self, key: Hashable, grad: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor | None:
        """Sync off: adds ``grad`` to ``key``'s held sum and returns None.  Sync on: ``grad`` plus
        the held sum (then cleared), or ``grad`` itself when nothing is held."""
        store = self._held.get(key)
        if not self.enabled and in_replica_group():
            # the held sum would be a variable written inside TF's vectoriser, which has no
            # per-group form for it (measured: the sum came back wrong, with no error)
            raise NotImplementedError(
                "set_requires_gradient_sync(False) / no_sync() under HSDP (a 2-D replicate x shard mesh): "
                "holding each replica group's unreduced gradients is not built. Use Keras' "
                "optimizer(gradient_accumulation_steps=k), or FSDP on a 1-D mesh.")
        if self.enabled:
            if store is None:
                return grad
            total = grad + tf.cast(store.read_value(), grad.dtype)
            with tf.control_dependencies([total]):
                store.assign(tf.zeros_like(store))
            return total
        if store is None:
            with tf.init_scope():  # made once, outside any traced step (a step may be traced again)
                zeros = dtensor.call_with_layout(tf.zeros, layout, shape=grad.shape, dtype=grad.dtype)
                store = dtensor.DVariable(zeros, trainable=False)
            self._held[key] = store
        store.assign_add(tf.cast(grad, store.dtype))
        return None

    @property
    def held_bytes(self) -> int:
        """Global bytes of the held sums (each device holds its 1/N of them)."""
        return sum(v.shape.num_elements() * v.dtype.size for v in self._held.values())
