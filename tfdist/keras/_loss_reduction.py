"""Keras' mean loss reduction as one mean, inside the step programs tfdist traces.

Keras reduces a batch of losses (``reduction="sum_over_batch_size"``, its default) as
``sum(values) / size(values)``.  On a batch-sharded DTensor that sum is an ``Add``
all-reduce of one scalar, and nothing later in the step depends on it, so TF DTensor's
all-reduce combiner (``dtensor_allreduce_combine_optimization.cc``) packs it into the
same flat buffer as the gradients' ``Add`` all-reduces -- first, since it comes first in
the program.  Every gradient after it then starts 4 bytes past a 64-byte boundary, and
TF's ``Slice`` copies an unaligned piece of a 1-D tensor where it would share an aligned
one (``IsDim0SliceAligned`` in ``slice_op.cc``): two kernel-sized copies per device per
step on a two-layer MLP; without them a data-parallel step of benchmarks/compare.py's W1
takes 0.935x the time (benchmarks/loss_reduction.py).

``tf.reduce_mean`` is a ``Mean`` all-reduce, which the combiner keeps in a group of its
own (it groups by reduce op), so the gradients stay aligned.  The value is the same
mean: ``mean(values)`` where Keras divides the sum by the static element count.
Anything else (``"sum"``, ``"mean_with_sample_weight"`` with weights, a shape not known
while tracing, an empty batch) keeps Keras' own reduction.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfdist import _patches
from tfdist.keras._keras_internals import loss_module

__all__ = ["mean_loss_reduction"]

_REDUCE_VALUES = "keras.src.losses.loss:reduce_values"
_MEANS = ("sum_over_batch_size", "mean")


def _as_one_mean(original, values, sample_weight=None, reduction="sum_over_batch_size"):
    shape = getattr(values, "shape", None)
    dims = None if shape is None or shape.rank is None else tuple(shape)
    by_size = reduction in _MEANS or (reduction == "mean_with_sample_weight" and sample_weight is None)
    if not by_size or dims is None or None in dims or dims == () or 0 in dims:
        return original(values, sample_weight, reduction)
    return loss_module.scale_loss_for_distribution(tf.reduce_mean(values))


def mean_loss_reduction() -> contextlib.AbstractContextManager:
    """Within the block (this thread), Keras reduces a loss by its mean as one ``tf.reduce_mean``.

    Example::

        with mean_loss_reduction():
            step = model.train_function.one_step.traced[0].get_concrete_function(batch)
    """
    return _patches.scoped(_REDUCE_VALUES, _as_one_mean)
