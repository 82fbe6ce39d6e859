"""An eager call as one traced program that an eager ``GradientTape`` can differentiate.

Under an eager tape TF differentiates a ``tf.function`` through a *separate* backward function,
whose inputs are the values the forward saved.  TF DTensor cannot lay such a function out where
the backward needs, as a constant, a value the forward made from constants: a transpose's inverse
permutation (``InvertPermutation`` of a saved permutation: "failed to extract constant value"),
a reduction's kept shape (``DynamicStitch``: "does not implement layout propagation"), or
tfdist's relayouts ("'func.func' op missing result layout attribute for function").  Traced as
one program, forward and backward together, the way a training step is, those values are
constants of the same graph and TF DTensor lays it out.

So ``TracedCall`` runs a function as a ``tf.function`` and, while a tape could record, records
the call on the tapes as one operation whose gradient is that second program (a vjp that runs
the forward again under its own tape): the forward runs twice under a tape, once otherwise.
Used by eager Keras layer calls on a mesh (``tfdist.keras._eager_calls``) and by the vectorised
``local_map`` (``tensor/experimental/_local_map.py``), whose ``tf.vectorized_map`` is such a
function when called eagerly.

Example::

    call = TracedCall(lambda x, w: tf.transpose(x) @ w)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(call(x, w))
    tape.gradient(loss, x)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops

__all__ = ["TracedCall"]


class TracedCall:
    """``fn`` as a ``tf.function``, recorded on eager tapes as one differentiable operation.

    Args:
        fn: the function; it may take and return composite tensors (tfdist DTensors).
        variables: returns the ``tf.Variable``s ``fn`` reads whose gradients a tape may ask for
            (a layer's trainable variables); called at every call, so it may change.
    """

    def __init__(self, fn: Callable[..., Any], variables: Callable[[], Sequence[tf.Variable]] = tuple):
        self._fn = fn
        self._variables = variables
        self.forward = tf.function(fn)
        self._vjp = tf.function(self._vjp_program)

    def _vjp_program(self, structure: Any, positions: tuple, out_positions: tuple,
                     output_gradients: list) -> list:
        """(args, kwargs), the float inputs' positions in their flat components, the tensor
        outputs' positions and their gradients -> gradients of those inputs and the variables."""
        flat = tf.nest.flatten(structure, expand_composites=True)
        sources = [flat[i] for i in positions]
        with tf.GradientTape() as tape:
            tape.watch(sources)
            args, kwargs = tf.nest.pack_sequence_as(structure, flat, expand_composites=True)
            outputs = self._fn(*args, **kwargs)
        flat_outputs = tf.nest.flatten(outputs, expand_composites=True)
        return tape.gradient([flat_outputs[i] for i in out_positions], sources + list(self._variables()),
                             output_gradients=output_gradients)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not record.could_possibly_record():
            return self.forward(*args, **kwargs)
        flat = tf.nest.flatten((args, kwargs), expand_composites=True)
        positions = tuple(i for i, x in enumerate(flat) if isinstance(x, tf.Tensor) and x.dtype.is_floating)
        variables = list(self._variables())
        with record.stop_recording():
            outputs = self.forward(*args, **kwargs)
        flat_outputs = tf.nest.flatten(outputs, expand_composites=True)
        out_positions = tuple(i for i, t in enumerate(flat_outputs) if isinstance(t, tf.Tensor))
        recorded = [flat_outputs[i] for i in out_positions]  # None and Python values have no gradient
        for variable in variables:  # what an eager read would tell the tape (watch_accessed_variables)
            resource_variable_ops.variable_accessed(variable)

        def gradient(*output_gradients):
            output_gradients = [tf.zeros_like(t) if g is None else g for t, g in zip(recorded, output_gradients)]
            return self._vjp((args, kwargs), positions, out_positions, output_gradients)

        record.record_operation("TfdistTracedCall", recorded, [flat[i] for i in positions]
                                + [v.handle for v in variables], gradient)
        return outputs
