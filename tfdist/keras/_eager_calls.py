"""Eager calls of layers on a mesh run as traced programs, also under an eager GradientTape.

Eager TF DTensor refuses an op that mixes a DTensor with a host tensor larger
than a scalar (``dtensor_device.cc``: "Currently only scalars and small
integer/string tensors are auto-broadcast to DTensors"), and layer code makes
such tensors everywhere: causal masks, position ids, ranges (keras-hub's
Gemma builds its mask in ``_compute_attention_mask``). Listing those sites
cannot end, so an eager call of a built layer whose variables are DTensors
that TF DTensor refuses this way runs again as a ``tf.function`` of Keras'
own ``Layer.__call__`` (and from then on directly): in a traced program those
tensors are constants that TF DTensor's layout propagation replicates. A
layer whose eager call works keeps eager semantics (torch's: hooks see eager
DTensors, eager checks raise); the innermost refused layer is the one traced.
A refused op fails before it runs, and the ops before it in a layer's call
compute values (a dropout seed advanced there advances again when traced).

Under an eager ``GradientTape`` TF would differentiate that function with a
separate backward function, which TF DTensor cannot compile for tfdist's
relayouts ("'func.func' op missing result layout attribute for function").
So the call is recorded on the tape as one operation whose gradient is a
second traced program, forward and backward together (as in ``fit``'s
step): the forward runs twice under a tape, once otherwise.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import tensorflow as tf
from keras.src.backend.common.keras_tensor import any_symbolic_tensors
from keras.src.backend.common.stateless_scope import in_stateless_scope
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops

from tfdist.keras import _variables

__all__ = ["runs_traced", "eager_call"]

_FORWARD: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_REFUSED = "but was expecting a DTensor"  # dtensor_device.cc's refusal of a host tensor
_FORWARD_AND_BACKWARD: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def runs_traced(layer: Any, args: tuple, kwargs: dict) -> bool:
    """``layer`` is built, holds DTensor variables, and computes values (no symbolic inputs,
    no stateless scope)."""
    return bool(layer.built) and not in_stateless_scope() and not any_symbolic_tensors(args, kwargs) and any(
        _variables.is_dtensor_variable(v) for v in layer.variables)


def _forward(layer: Any, call: Callable) -> Any:
    function = _FORWARD.get(layer)
    if function is None:
        function = _FORWARD[layer] = tf.function(lambda *args, **kwargs: call(layer, *args, **kwargs))
    return function


def _forward_and_backward(layer: Any, call: Callable) -> Any:
    """A traced vjp: (args, kwargs, float inputs' positions, tensor outputs' positions, their
    gradients) -> gradients of the float inputs and of the layer's trainable variables."""
    function = _FORWARD_AND_BACKWARD.get(layer)
    if function is None:
        def vjp(structure, positions, out_positions, output_gradients):
            flat = tf.nest.flatten(structure, expand_composites=True)  # tfdist DTensors: their tensors
            sources = [flat[i] for i in positions]
            with tf.GradientTape() as tape:
                tape.watch(sources)
                args, kwargs = tf.nest.pack_sequence_as(structure, flat, expand_composites=True)
                outputs = call(layer, *args, **kwargs)
            variables = [v.value for v in layer.trainable_variables]
            flat_outputs = tf.nest.flatten(outputs, expand_composites=True)
            return tape.gradient([flat_outputs[i] for i in out_positions], sources + variables,
                                 output_gradients=output_gradients)

        function = _FORWARD_AND_BACKWARD[layer] = tf.function(vjp)
    return function


def eager_call(layer: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
    """``call(layer, *args, **kwargs)`` eagerly; where TF DTensor refuses a host tensor in it,
    traced (recorded as one operation on active tapes)."""
    if layer not in _FORWARD:
        try:
            return call(layer, *args, **kwargs)
        except tf.errors.UnimplementedError as error:
            if _REFUSED not in str(error):
                raise
    return _traced_call(layer, call, args, kwargs)


def _traced_call(layer: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
    forward = _forward(layer, call)
    if not record.could_possibly_record():
        return forward(*args, **kwargs)
    flat = tf.nest.flatten((args, kwargs), expand_composites=True)
    positions = tuple(i for i, x in enumerate(flat) if isinstance(x, tf.Tensor) and x.dtype.is_floating)
    variables = [v._value for v in layer.trainable_variables]  # DVariables or plain tf.Variables
    with record.stop_recording():
        outputs = forward(*args, **kwargs)
    flat_outputs = tf.nest.flatten(outputs, expand_composites=True)
    out_positions = tuple(i for i, t in enumerate(flat_outputs) if isinstance(t, tf.Tensor))
    recorded = [flat_outputs[i] for i in out_positions]  # None and Python values have no gradient
    for variable in variables:  # what an eager read would tell the tape (watch_accessed_variables)
        resource_variable_ops.variable_accessed(variable)
    backward = _forward_and_backward(layer, call)

    def gradient(*output_gradients):
        output_gradients = [tf.zeros_like(t) if g is None else g for t, g in zip(recorded, output_gradients)]
        return backward((args, kwargs), positions, out_positions, output_gradients)

    record.record_operation("TfdistEagerLayerCall", recorded, [flat[i] for i in positions]
                            + [v.handle for v in variables], gradient)
    return outputs
