"""Plain tf.Tensors into a tensor-parallel model: eager, in tf.function, in predict.

torch annotates a plain input with the style's input_layouts (Replicate by
default); tfdist replicates a plain tensor onto the mesh of the function's
DTensors, in eager calls and at the call of a tf.function.  Reference: the
same model on one device.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import make_mlp, max_weight_diff, no_global_distribution  # noqa: F401
from tfdist.keras._data import gather_to_numpy
from tfdist.keras._host_tensors import lift_plain_inputs
from tfdist.tensor import Shard
from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

RNG = np.random.default_rng(5)
X = RNG.standard_normal((64, 16)).astype("float32")
Y = RNG.standard_normal((64, 8)).astype("float32")
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def tp_mlp():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    return parallelize_module(make_mlp(), mesh["tp"], PLAN)


def custom_loop(model, steps=4, batch=16):
    """The TF custom training loop: tf.function + GradientTape, plain tensors in."""
    optimizer = keras.optimizers.SGD(0.05)
    mse = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return [float(train_step(tf.constant(X[i * batch:(i + 1) * batch]), tf.constant(Y[i * batch:(i + 1) * batch])))
            for i in range(steps)]


def test_custom_tf_function_loop_with_plain_inputs_equals_one_device_and_fit():
    ref = make_mlp()
    ref_losses = custom_loop(ref)
    model = tp_mlp()
    losses = custom_loop(model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_weight_diff(ref, model) < 1e-5

    fitted = tp_mlp()
    fitted.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    hist = fitted.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0, steps_per_epoch=4)
    assert max_weight_diff(fitted, model) < 1e-5
    np.testing.assert_allclose(hist.history["loss"][0], np.mean(losses), rtol=1e-5)


def test_eager_call_predict_and_tf_function_forward_take_plain_tensors():
    ref = make_mlp()
    want = ref(X[:8]).numpy()
    model = tp_mlp()
    np.testing.assert_allclose(model.predict(X[:8], verbose=0), want, atol=1e-5)
    for got in (model(tf.constant(X[:8])), tf.function(model)(tf.constant(X[:8])), model(X[:8])):
        np.testing.assert_allclose(gather_to_numpy(got), want, atol=1e-5)


def test_lift_leaves_functions_without_dtensors_and_scalars_alone():
    plain = tf.constant(X[:2])
    assert lift_plain_inputs([plain], [])[0] is plain  # no DTensor: TF's own rules
    mesh = tfdist.init_device_mesh("cpu", (8,))
    on_mesh = tfdist.tensor.distribute_tensor(tf.constant(X[:8]), mesh, [Shard(0)]).to_tf()
    scalar = tf.constant(2.0)
    lifted = lift_plain_inputs([plain, scalar, on_mesh], [])
    assert tf.experimental.dtensor.fetch_layout(lifted[0]).is_fully_replicated()
    assert lifted[1] is scalar and lifted[2] is on_mesh
    np.testing.assert_array_equal(tf.experimental.dtensor.unpack(lifted[0])[3].numpy(), X[:2])


def test_a_plain_tensor_next_to_dtensors_in_a_raw_tf_function():
    mesh = tfdist.init_device_mesh("cpu", (8,))
    a = tfdist.tensor.distribute_tensor(tf.constant(X[:8]), mesh, [Shard(0)]).to_tf()
    got = tf.function(lambda u, v: u + v)(a, tf.constant(X[8:16]))
    np.testing.assert_allclose(gather_to_numpy(got), X[:8] + X[8:16])
