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


@pytest.mark.parametrize("distribution", ["model_parallel", "data_parallel"])
def test_eager_call_under_keras_distribution_takes_numpy_and_tensors(distribution):
    """``model(x)`` on arrays, before and after the model is built, as on one device: the
    inputs are replicated onto the model's mesh (TF DTensor refuses host tensors)."""
    ids = RNG.integers(0, 32, (4, 6)).astype("int32")

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(32, 8, name="emb")(inputs)
        return keras.Model(inputs, keras.layers.Dense(16, name="proj")(h))

    reference = build()
    want = reference(ids).numpy()
    if distribution == "model_parallel":
        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*emb/embeddings"] = ("model", None)
        layout_map[".*proj/kernel"] = (None, "model")
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    else:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = build()
    for x in (ids, tf.constant(ids)):
        np.testing.assert_allclose(gather_to_numpy(model(x)), want, rtol=1e-5, atol=1e-6)
    layer = model.get_layer("proj")  # a built layer alone, on a float array
    h = reference.get_layer("emb")(ids).numpy()
    np.testing.assert_allclose(gather_to_numpy(layer(h)), reference.get_layer("proj")(h).numpy(), rtol=1e-5, atol=1e-6)


def test_first_eager_call_builds_a_subclassed_model_under_a_distribution():
    """Before the first call there are no variables: the inputs go to the distribution's mesh."""
    from tfdist.models import MLP

    x = RNG.standard_normal((4, 8)).astype("float32")
    keras.utils.set_random_seed(4)
    want = MLP(8, 16)(x).numpy()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(4)
    np.testing.assert_allclose(gather_to_numpy(MLP(8, 16)(x)), want, rtol=1e-5, atol=1e-6)
