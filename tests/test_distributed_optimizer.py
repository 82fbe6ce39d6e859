"""DistributedOptimizer over tfdist.autograd contexts (torch's dist_autograd + DistributedOptimizer):
sharded (FSDP) and replicated variables stepped like one device's optimizer."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import max_weight_diff, no_global_distribution, regression_batch, tanh_mlp  # noqa: F401
from tfdist.fsdp import fully_shard
from tfdist.optim import DistributedOptimizer

X, Y = regression_batch(7, 16, 8, 4)
MSE = keras.losses.MeanSquaredError()


def make():
    return tanh_mlp(8, 16, 4)


def reference(steps, scale=1.0):
    """One device, plain Keras SGD on ``scale`` x the loss."""
    model, opt = make(), keras.optimizers.SGD(0.1)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = scale * MSE(Y, model(X))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return model


def sharded():
    model = make()
    mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_step_from_a_context_equals_one_device_on_sharded_variables():
    model = sharded()
    opt = DistributedOptimizer(keras.optimizers.SGD, model.trainable_variables, learning_rate=0.1)
    for _ in range(3):
        with tfdist.autograd.context() as context_id:
            loss = MSE(Y, model(X))
            tfdist.autograd.backward(context_id, [loss])
            grads = tfdist.autograd.get_gradients(context_id)
            assert len(grads) == len(model.trainable_variables)
            opt.step(context_id)
    assert max_weight_diff(reference(3), model) < 1e-6


def test_backward_calls_in_one_context_accumulate_and_traced_steps_work():
    model = sharded()
    opt = DistributedOptimizer(keras.optimizers.SGD, model.trainable_variables, learning_rate=0.1)

    @tf.function
    def step(x, y):
        with tfdist.autograd.context() as context_id:
            loss = MSE(y, model(x))
            tfdist.autograd.backward(context_id, [loss])
            tfdist.autograd.backward(context_id, [loss])  # twice: the gradients add up
            opt.step(context_id)

    for _ in range(2):
        step(tf.constant(X), tf.constant(Y))
    assert max_weight_diff(reference(2, scale=2.0), model) < 1e-6


def test_explicit_grads_and_bad_input():
    model = make()
    opt = DistributedOptimizer(keras.optimizers.SGD, model.trainable_variables, learning_rate=0.1)
    with tf.GradientTape() as tape:
        loss = MSE(Y, model(X))
    opt.step(grads=tape.gradient(loss, model.trainable_variables))
    assert max_weight_diff(reference(1), model) < 1e-6
    with pytest.raises(ValueError, match="Keras optimizer class"):
        DistributedOptimizer(keras.optimizers.SGD(), model.trainable_variables)
    with pytest.raises(ValueError, match="context_id .* or grads"):
        opt.step()
    with tfdist.autograd.context() as context_id:
        pass
    with pytest.raises(ValueError, match="not an open context"):
        opt.step(context_id)
    with tfdist.autograd.context() as context_id:
        with pytest.raises(RuntimeError, match="no backward pass"):
            opt.step(context_id)
