"""Keras' mean loss reduction as one ``tf.reduce_mean`` (tfdist.keras._loss_reduction): the same
values as Keras' own reduction, checked against numpy, and the traced graph reduces by a mean."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist.keras  # noqa: F401  (the Keras plug-in)
from tfdist.keras._loss_reduction import mean_loss_reduction

RNG = np.random.default_rng(3)
Y_TRUE = RNG.standard_normal((6, 4)).astype(np.float32)
Y_PRED = RNG.standard_normal((6, 4)).astype(np.float32)
WEIGHTS = RNG.uniform(0.0, 2.0, (6,)).astype(np.float32)
PER_SAMPLE = ((Y_TRUE - Y_PRED) ** 2).mean(axis=1)


@pytest.mark.parametrize("reduction, weighted, expected", [
    ("sum_over_batch_size", False, PER_SAMPLE.mean()),
    ("sum_over_batch_size", True, (PER_SAMPLE * WEIGHTS).sum() / PER_SAMPLE.size),
    ("mean_with_sample_weight", False, PER_SAMPLE.mean()),
    ("mean_with_sample_weight", True, (PER_SAMPLE * WEIGHTS).sum() / WEIGHTS.sum()),
    ("sum", True, (PER_SAMPLE * WEIGHTS).sum()),
    ("none", True, PER_SAMPLE * WEIGHTS),
])
def test_reduction_inside_the_scope_equals_numpys(reduction, weighted, expected):
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    weights = WEIGHTS if weighted else None
    with mean_loss_reduction():
        got = loss(Y_TRUE, Y_PRED, sample_weight=weights)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(loss(Y_TRUE, Y_PRED, sample_weight=weights)), rtol=1e-6)


def _reductions(fn, *specs) -> set:
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return {op.type for op in graph.get_operations()} & {"Sum", "Mean", "DivNoNan"}


def test_a_static_batch_is_reduced_by_one_mean_and_a_relaxed_one_as_keras_does():
    loss = keras.losses.MeanSquaredError()

    def scoped(y_true, y_pred):
        with mean_loss_reduction():
            return loss(y_true, y_pred)

    static = [tf.TensorSpec((6, 4), tf.float32)] * 2
    relaxed = [tf.TensorSpec((None, 4), tf.float32)] * 2
    assert _reductions(loss, *static) == {"Mean", "Sum", "DivNoNan"}  # Keras: per-sample mean, sum / size
    assert _reductions(scoped, *static) == {"Mean"}
    assert _reductions(scoped, *relaxed) == {"Mean", "Sum", "DivNoNan"}  # size unknown: Keras' own
    got = tf.function(scoped, input_signature=relaxed)(Y_TRUE, Y_PRED)
    np.testing.assert_allclose(float(got), PER_SAMPLE.mean(), rtol=1e-6)


@pytest.mark.parametrize("shape", [(0,), (0, 3)])
def test_an_empty_batch_reduces_as_keras_reduces_it(shape):
    from keras.src.losses import loss as keras_loss

    empty = tf.zeros(shape)
    with mean_loss_reduction():
        got = keras_loss.reduce_values(empty)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(keras_loss.reduce_values(empty)))
    assert not np.isnan(np.asarray(got)).any()


def test_outside_the_scope_keras_reduction_is_untouched():
    from keras.src.losses import loss as keras_loss

    from tfdist import _patches

    before = keras_loss.reduce_values
    with mean_loss_reduction():
        pass
    assert keras_loss.reduce_values is before is _patches.original("keras.src.losses.loss:reduce_values")
