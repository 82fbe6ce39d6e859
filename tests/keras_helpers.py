"""Shared pieces of the Keras tests: clean global state and an independent reference optimizer."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf


class DenseAdam(keras.optimizers.Adam):
    """Plain Keras Adam fed dense gradients (textbook Adam).

    Keras 3's Adam on an IndexedSlices gradient with repeated rows differs
    from textbook Adam (docs/tf_dtensor_repros/keras3_adam_duplicate_indexed_slices.py);
    tfdist gives dense gradients on DTensor, so the one-device reference must too.
    """

    def apply(self, grads, trainable_variables=None):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return super().apply(grads, trainable_variables)


@pytest.fixture(autouse=True)
def no_global_distribution():
    """Every test starts and ends without a keras distribution."""
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


@pytest.fixture
def float64():
    """Keras computes in float64 (floatx and dtype policy) for 1e-9 comparisons; restored after."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)


def logits_loss_grads(model, ids, labels):
    """Logits, sparse cross-entropy and its gradients for the model's trainable variables."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        logits = model(ids)
        loss = loss_fn(labels, logits)
    return logits, loss, tape.gradient(loss, model.trainable_variables)


def on_one_device(model: keras.Model) -> keras.Model:
    """``model`` on a mesh of one device: the one-device reference that draws dropout and noise
    with tfdist's mesh-invariant stream (a plain model keeps Keras' own stream)."""
    import tfdist
    from tfdist.tensor.parallel import parallelize_module

    return parallelize_module(model, tfdist.DeviceMesh("cpu", [0]), {})


def max_weight_diff(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a.get_weights(), b.get_weights()))


def make_mlp() -> keras.Model:
    """The seeded 16 -> 32 (relu) -> 8 MLP the Keras tests train (layers 'up' and 'down')."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dense(8, name="down"),
    ])


def tanh_mlp(n_in: int, hidden: int, n_out: int) -> keras.Model:
    """A seeded n_in -> hidden (tanh) -> n_out MLP."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((n_in,)), keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(n_out)])


def regression_batch(seed: int, rows: int, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 inputs and targets drawn from a seeded normal."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, n_in)).astype("float32"), rng.standard_normal((rows, n_out)).astype("float32"))


def model_parallel(mesh_shape=(2, 4)) -> keras.distribution.ModelParallel:
    """Megatron layouts for make_mlp on a (batch, model) mesh."""
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def sum_sq_grads(model, x):
    """Gradients of sum(model(x)^2) for the model's trainable variables."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        y = model(x)
        loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, model.trainable_variables)


def traced_sum_sq_grads(model, x):
    """``sum_sq_grads`` traced, under CommDebugMode: (grads, the CommDebugMode)."""
    import tensorflow as tf

    from tfdist.tensor.debug import CommDebugMode

    step = tf.function(lambda x: sum_sq_grads(model, x))
    with CommDebugMode() as comm:
        grads = step(x)
    return grads, comm
