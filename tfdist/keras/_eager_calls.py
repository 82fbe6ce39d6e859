"""Eager calls of layers on a mesh run as traced programs, also under an eager GradientTape.

Eager TF DTensor refuses an op that mixes a DTensor with a host tensor larger
than a scalar (``dtensor_device.cc``: "Currently only scalars and small
integer/string tensors are auto-broadcast to DTensors"), and layer code makes
such tensors everywhere: causal masks, position ids, ranges (keras-hub's
Gemma builds its mask in ``_compute_attention_mask``). Listing those sites
cannot end, so an eager call of a built layer whose variables are DTensors
that TF DTensor refuses this way runs again as a ``tf.function`` of Keras'
own ``Layer.__call__`` (and from then on directly): in a traced program those
tensors are constants that TF DTensor's layout propagation replicates.  So does a layer with an
eager op whose SPMD expander refuses its operands' layouts (a ``Conv2D`` whose kernel is sharded
on its channels, ``conv_spmd_expander.cc``): op by op nothing can change those layouts; traced,
``tensor/_legalize.py`` pins the op to layouts its expander accepts. A
layer whose eager call works keeps eager semantics (torch's: hooks see eager
DTensors, eager checks raise); the innermost refused layer is the one traced.
A refused op fails before it runs, and the ops before it in a layer's call
compute values (a dropout seed advanced there advances again when traced).

Under an eager ``GradientTape`` the traced call is recorded as one operation whose gradient is
a second traced program, forward and backward together (``tfdist.tensor._traced_call``: TF
DTensor cannot compile the separate backward function TF would make, "'func.func' op missing
result layout attribute for function").
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import tensorflow as tf

from tfdist.keras import _variables
from tfdist.keras._keras_internals import any_symbolic_tensors, in_stateless_scope
from tfdist.tensor import _legalize
from tfdist.tensor._traced_call import TracedCall

__all__ = ["runs_traced", "eager_call"]

_TRACED: "weakref.WeakKeyDictionary[Any, TracedCall]" = weakref.WeakKeyDictionary()
_REFUSED = "but was expecting a DTensor"  # dtensor_device.cc's refusal of a host tensor
_EAGER_OP = '"eager_operation"'  # the MLIR location TF DTensor gives an eager op it compiles


def runs_traced(layer: Any, args: tuple, kwargs: dict) -> bool:
    """``layer`` is built, holds DTensor variables, and computes values (no symbolic inputs,
    no stateless scope)."""
    return bool(layer.built) and not in_stateless_scope() and not any_symbolic_tensors(args, kwargs) and any(
        _variables.is_dtensor_variable(v) for v in layer.variables)


def eager_call(layer: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
    """``call(layer, *args, **kwargs)`` eagerly; where TF DTensor refuses a host tensor in it,
    traced (recorded as one operation on active tapes)."""
    traced = _TRACED.get(layer)
    if traced is None:
        try:
            return call(layer, *args, **kwargs)
        except tf.errors.OpError as error:
            refused_host_tensor = isinstance(error, tf.errors.UnimplementedError) and _REFUSED in str(error)
            # an eager op whose expander refuses its layouts: traced, its program is legalized
            # (every tf.function call goes through tensor/_legalize.py), op by op it cannot be
            # (or an eager op TF DTensor cannot compile at all: "eager_operation" is its location)
            if not (refused_host_tensor or _legalize.parse_failure(error, (args, kwargs)) is not None
                    or (isinstance(error, tf.errors.UnknownError) and _EAGER_OP in str(error))):
                raise
        ref = weakref.ref(layer)  # a strong reference from the cached value would keep the layer alive
        traced = _TRACED[layer] = TracedCall(
            lambda *a, **k: call(ref(), *a, **k),
            variables=lambda: [v._value for v in ref().trainable_variables])  # DVariables or tf.Variables
    return traced(*args, **kwargs)
