"""Host (layout-less) tensors meeting DTensors: function arguments and eager gradients.

Eager TF DTensor refuses an op that mixes a DTensor with a host tensor
larger than a scalar.  Two places where users hand TensorFlow host tensors
without meaning to are handled here.

1. Plain tensors passed to a ``tf.function`` that works on DTensors.

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

2. The first gradient of an eager ``GradientTape.gradient``.  TF seeds it
with a host ``1`` and the gradient of ``reduce_sum`` tiles that seed on the
host (``math_grad._SumGrad``), so the next gradient op meets a host
``[batch, ...]`` tensor and a DTensor and fails -- any eager training step
on a distributed model.  tfdist seeds a DTensor target with
``ones_like(target)``, a DTensor of the target's layout (what
``output_gradients`` would be by hand).

3. Tensors a layer makes while it runs (masks, ranges, position ids) next
to DTensors: the eager call of a built layer on a mesh runs traced
(``tfdist.keras._eager_calls``), where they are constants TF DTensor
replicates itself. Plain inputs are first replicated onto the layer's mesh (4).

4. A model or layer called eagerly on a plain tensor or array (``model(x)``
to build or try a model under ``keras.distribution``): the inputs are
replicated onto the mesh of the layer's variables (before it is built, the
active distribution's mesh) -- torch's ``Replicate`` annotation; inside,
the layouts apply as in ``fit``.

5. Labels and sample weights given to a Keras loss next to DTensor
predictions, eagerly: replicated onto the predictions' mesh (torch's
``Replicate`` annotation of a plain tensor).

Scope: these rows sit on TF's and Keras' call paths for the whole process,
so each first asks whether the call can involve tfdist at all: a layer call
only once a Keras variable was placed on a mesh or under a keras
distribution, the others only once TF's DTensor device has a mesh.  Otherwise
each hands the call straight to TensorFlow's or Keras' own function -- a
process that imports tfdist.keras and runs plain models traces the same
graphs (tests/test_architecture.py); the cost is measured in
benchmarks/plain_code_overhead.py.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.dtensor.python import api as _dtensor_api
from tensorflow.python.eager import context

import keras

from tfdist import _patches
from tfdist.keras import _compiled_forward, _variables
from tfdist.keras._backend import mesh_variables_exist, tfdist_mesh
from tfdist.keras._data import gather_to_numpy
from tfdist.keras._eager_calls import eager_call, runs_traced

_NAME = "tensorflow.python.eager.polymorphic_function.concrete_function:ConcreteFunction._call_flat"
_GRADIENT = "tensorflow.python.eager.backprop:GradientTape.gradient"
_LOSS_CALL = "keras.src.losses.loss:Loss.__call__"
_LAYER_CALL = "keras.src.layers.layer:Layer.__call__"
_NOT_DATA = (tf.resource, tf.variant)


def dtensor_in_use() -> bool:
    """A DTensor can exist in this process: TF's DTensor device exists and has a mesh (every
    DTensor lives on a registered mesh).  Keras makes the device without a mesh; asking
    ``dtensor.is_dtensor`` before any device would make one."""
    device = _dtensor_api._dtensor_singleton
    return device is not None and bool(device.meshes)


def _on_dtensor_device(t: Any) -> bool:
    """An eager tensor (or variable handle) on TF's DTensor device: ``dtensor.is_dtensor``, asked by
    device name (a twentieth of its cost: these run on every traced-function call)."""
    device = _dtensor_api._dtensor_singleton
    return device is not None and isinstance(t, tf.Tensor) and t.device == device.name


def _is_plain(t: Any) -> bool:
    """An eager data tensor with no layout that TF would not broadcast by itself."""
    return (
        isinstance(t, tf.Tensor) and hasattr(t, "numpy") and t.dtype not in _NOT_DATA
        and t.shape.rank and not _on_dtensor_device(t)
    )


def _mesh_of(tensors: Sequence[Any]) -> dtensor.Mesh | None:
    """The one mesh of the DTensors among ``tensors`` (None: none, or several)."""
    meshes = {dtensor.fetch_layout(t).mesh for t in tensors if _on_dtensor_device(t)}
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


def dtensor_seeds(target: Any) -> list[Any] | None:
    """``output_gradients`` for an eager tape: ones like each DTensor target (None if none is)."""
    flat = tf.nest.flatten(target)
    if not any(_on_dtensor_device(t) for t in flat):
        return None
    return [tf.ones_like(t) if _on_dtensor_device(t) else None for t in flat]


def beside(mask: Any, like: Any) -> Any:
    """An eager host ``mask`` copied, replicated, onto the mesh of DTensor ``like``."""
    if tf.executing_eagerly() and _on_dtensor_device(like) \
            and isinstance(mask, tf.Tensor) and not _on_dtensor_device(mask):
        mesh = dtensor.fetch_layout(like).mesh
        return dtensor.copy_to_mesh(mask, dtensor.Layout.replicated(mesh, mask.shape.rank))
    return mask


def _as_tensor(value: Any) -> Any:
    """Arrays become tensors; other values (None, nested structures) stay as they are."""
    return tf.convert_to_tensor(value) if isinstance(value, np.ndarray) else value


def _layer_mesh(layer: Any) -> dtensor.Mesh | None:
    """The one mesh of ``layer``'s DTensor variables; before it has any, the active keras
    distribution's mesh (None: neither, or variables on several meshes)."""
    variables = layer.variables
    if variables:
        meshes = {_variables.compute_mesh(v) for v in variables if _variables.is_dtensor_variable(v)}
        return meshes.pop() if len(meshes) == 1 else None
    distribution = keras.distribution.distribution()
    return tfdist_mesh(distribution.device_mesh).to_tf() if distribution is not None else None


def lift_layer_inputs(layer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` of an eager layer call with plain tensors and arrays replicated onto
    the layer's mesh; unchanged when there is none (the usual case: a cheap scan)."""
    flat = tf.nest.flatten((args, kwargs))
    plain = [isinstance(x, np.ndarray) and x.ndim and x.dtype.kind in "biuf" or _is_plain(x) for x in flat]
    if not any(plain):
        return args, kwargs
    mesh = _layer_mesh(layer)
    if mesh is None:
        return args, kwargs
    flat = [dtensor.copy_to_mesh(tf.convert_to_tensor(x), dtensor.Layout.replicated(mesh, np.ndim(x))) if p else x
            for x, p in zip(flat, plain)]
    return tf.nest.pack_sequence_as((args, kwargs), flat)


def _install_layer_inputs() -> None:
    original = _patches.original(_LAYER_CALL)

    def call(self, *args, **kwargs):
        if _compiled_forward.routes(self):  # a step program's forward, compiled per device
            return _compiled_forward.call(self, original, args, kwargs)
        if not (mesh_variables_exist() or keras.distribution.distribution() is not None) \
                or not tf.executing_eagerly():
            return original(self, *args, **kwargs)
        args, kwargs = lift_layer_inputs(self, args, kwargs)
        if runs_traced(self, args, kwargs):  # tensors the layer makes meet DTensors (_eager_calls)
            return eager_call(self, original, args, kwargs)
        return original(self, *args, **kwargs)

    _patches.install(_LAYER_CALL, call)


def _install_loss_inputs() -> None:
    original = _patches.original(_LOSS_CALL)

    def call(self, y_true, y_pred, sample_weight=None):
        if tf.executing_eagerly() and _on_dtensor_device(y_pred):
            y_true = beside(_as_tensor(y_true), y_pred)
            sample_weight = beside(_as_tensor(sample_weight), y_pred)
        return original(self, y_true, y_pred, sample_weight)

    _patches.install(_LOSS_CALL, call)


def install() -> None:
    _install_loss_inputs()
    _install_layer_inputs()
    _install_convert_to_numpy()
    original_gradient = _patches.original(_GRADIENT)

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        if output_gradients is None and dtensor_in_use() and context.executing_eagerly():
            output_gradients = dtensor_seeds(target)
        return original_gradient(self, target, sources, output_gradients, unconnected_gradients)

    _patches.install(_GRADIENT, gradient)
    original = _patches.original(_NAME)

    def call_flat(self, tensor_inputs, captured_inputs):
        if dtensor_in_use() and context.executing_eagerly():
            # arguments, and tensors the function captured from Python (a target in a closure)
            lifted = lift_plain_inputs(list(tensor_inputs) + list(captured_inputs), ())
            tensor_inputs, captured_inputs = lifted[:len(tensor_inputs)], lifted[len(tensor_inputs):]
        return original(self, tensor_inputs, captured_inputs)

    _patches.install(_NAME, call_flat)


def _install_convert_to_numpy() -> None:
    name = "keras.src.backend:convert_to_numpy"
    original = _patches.original(name)

    def convert_to_numpy(x):
        if _on_dtensor_device(x):
            return np.array(gather_to_numpy(x))
        return original(x)

    _patches.install(name, convert_to_numpy)
