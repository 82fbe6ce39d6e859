"""Plain tensors passed to a ``tf.function`` that works on DTensors.

torch annotates a plain input of a parallelized module with the style's
``input_layouts`` (``Replicate()`` by default): every rank holds the whole
input.  In TensorFlow the same call -- a custom training loop, ``@tf.function``
with ``GradientTape``, calling a tensor-parallel model on a ``tf.Tensor`` --
fails before any of tfdist's code runs: the DTensor device refuses a
function whose captured variables are DTensors and whose arguments are not
("got a regular tensor for input 0 ... but was expecting a DTensor";
``dtensor_device.cc`` only broadcasts scalars and small integer tensors).

So at the call of a traced function (``ConcreteFunction._call_flat``),
eager plain tensor arguments are copied onto the mesh of the function's
DTensor inputs as replicated DTensors -- torch's annotation.  Inside, the
styles relayout them (a local slice to the batch shard), exactly as for an
eager call.  Functions with no DTensor input, or with DTensors of several
meshes, are left to TensorFlow.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context

from tfdist import _patches

_NAME = "tensorflow.python.eager.polymorphic_function.concrete_function:ConcreteFunction._call_flat"
_NOT_DATA = (tf.resource, tf.variant)


def _is_plain(t: Any) -> bool:
    """An eager data tensor with no layout that TF would not broadcast by itself."""
    return (
        isinstance(t, tf.Tensor) and hasattr(t, "numpy") and t.dtype not in _NOT_DATA
        and t.shape.rank and not dtensor.is_dtensor(t)
    )


def _mesh_of(tensors: Sequence[Any]) -> dtensor.Mesh | None:
    """The one mesh of the DTensors among ``tensors`` (None: none, or several)."""
    meshes = {dtensor.fetch_layout(t).mesh for t in tensors if isinstance(t, tf.Tensor) and dtensor.is_dtensor(t)}
    return meshes.pop() if len(meshes) == 1 else None


def lift_plain_inputs(tensor_inputs: Sequence[Any], captured_inputs: Sequence[Any]) -> list[Any]:
    """``tensor_inputs`` with plain eager tensors replicated onto the DTensors' mesh."""
    plain = [i for i, t in enumerate(tensor_inputs) if _is_plain(t)]
    if not plain:
        return list(tensor_inputs)
    mesh = _mesh_of(list(tensor_inputs) + list(captured_inputs))
    if mesh is None:
        return list(tensor_inputs)
    out = list(tensor_inputs)
    for i in plain:
        out[i] = dtensor.copy_to_mesh(out[i], dtensor.Layout.replicated(mesh, out[i].shape.rank))
    return out


def install() -> None:
    original = _patches.original(_NAME)

    def call_flat(self, tensor_inputs, captured_inputs):
        if context.executing_eagerly():
            tensor_inputs = lift_plain_inputs(tensor_inputs, captured_inputs)
        return original(self, tensor_inputs, captured_inputs)

    _patches.install(_NAME, call_flat)
