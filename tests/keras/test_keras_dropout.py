"""Dropout on any mesh draws the same mask as on one device (same seed).

Reference: the model with the same Keras seed on a mesh of one device
(``keras_helpers.on_one_device``); the dropout statistics are checked
against the rate; a plain model keeps Keras' own stream.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import DenseAdam, float64, no_global_distribution, on_one_device  # noqa: F401
from tfdist.keras._data import gather_to_numpy
from tfdist.models import GPT, parallelize_gpt
from tfdist.tensor import Shard, distribute_tensor
from tfdist.tensor._random import dropout

X = np.random.default_rng(2).standard_normal((8, 16, 32)).astype("float32")


@pytest.mark.parametrize("placements", [[Shard(0), Shard(2)], [Shard(1), Shard(0)], [Shard(2), Shard(1)]])
def test_dropout_mask_is_the_same_for_every_layout(placements):
    seed = tf.constant([5, 9])
    want = dropout(tf.constant(X), 0.25, seed=seed).numpy()
    mesh = tfdist.init_device_mesh("cpu", (2, 4))
    x = distribute_tensor(tf.constant(X), mesh, placements).to_tf()
    np.testing.assert_array_equal(gather_to_numpy(dropout(x, 0.25, seed=seed)), want)
    np.testing.assert_array_equal(gather_to_numpy(tf.function(dropout)(x, 0.25, seed=seed)), want)


def test_dropout_keeps_one_minus_rate_and_rescales():
    y = dropout(tf.ones((256, 256)), 0.3, seed=tf.constant([1, 2])).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01  # 65536 draws: 5 sigma is 0.009
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    other = dropout(tf.ones((256, 256)), 0.3, seed=tf.constant([1, 3])).numpy() != 0
    assert 0.45 < (kept == other).mean() < 0.65  # another seed: another mask (0.7^2 + 0.3^2 = 0.58)


def test_noise_shape_broadcasts_the_mask():
    y = dropout(tf.ones((4, 8, 16)), 0.5, noise_shape=[4, 1, 16], seed=tf.constant([3, 3])).numpy()
    assert (y == y[:, :1, :]).all()


V, S = 32, 8


@pytest.mark.usefixtures("float64")
def test_gpt_with_dropout_trains_like_one_device():
    """A seeded GPT with dropout 0.1, trained with fit on a 2x4 mesh (SP plan) and on one
    device: the same losses and weights (float64), because the masks are the same."""
    rng = np.random.default_rng(4)
    ids, nxt = rng.integers(0, V, (48, S)), rng.integers(0, V, (48, S))

    def make(rate=0.1):
        keras.utils.set_random_seed(0)
        model = GPT(V, S, dim=16, heads=4, depth=1, dropout=rate)
        model(ids[:1])
        return model

    def train(model):
        model.compile(optimizer=DenseAdam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(ids, nxt, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]

    ref = on_one_device(make())
    keras.utils.set_random_seed(1)
    ref_loss = train(ref)
    model = parallelize_gpt(make(), tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")),
                            sequence_parallel=True)
    keras.utils.set_random_seed(1)
    np.testing.assert_allclose(train(model), ref_loss, rtol=1e-9)
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-9)
    keras.utils.set_random_seed(1)
    assert abs(train(on_one_device(make(rate=0.0)))[0] - ref_loss[0]) > 1e-4  # dropout did act


def test_draw_like_statistics():
    seed = tf.constant([4, 2])
    z = tfdist.tensor._random.draw_like("normal", (200, 300), seed, tf.float64).numpy()
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02  # 60000 draws: 5 sigma is 0.02
    u = tfdist.tensor._random.draw_like("uniform", (200, 300), seed, tf.float64, a=2.0, b=5.0).numpy()
    assert u.min() >= 2.0 and u.max() < 5.0 and abs(u.mean() - 3.5) < 0.03


@pytest.mark.usefixtures("float64")
def test_noise_layers_train_like_one_device():
    """GaussianNoise, GaussianDropout and AlphaDropout between tensor-parallel Dense layers:
    fit on a 2x4 mesh equals one device (same seed, float64)."""
    from keras_helpers import max_weight_diff
    from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((64, 16)), rng.standard_normal((64, 8))

    def make(noise=True):
        keras.utils.set_random_seed(0)
        layers = [keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up")]
        if noise:
            layers += [keras.layers.GaussianNoise(0.3), keras.layers.GaussianDropout(0.2),
                       keras.layers.AlphaDropout(0.2)]
        return keras.Sequential(layers + [keras.layers.Dense(8, name="down")])

    def train(model):
        keras.utils.set_random_seed(1)
        model.compile(optimizer=DenseAdam(1e-2), loss="mse")
        return model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]

    ref = on_one_device(make())
    want = train(ref)
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(make(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    np.testing.assert_allclose(train(model), want, rtol=1e-9)
    assert max_weight_diff(ref, model) < 1e-9
    assert abs(train(on_one_device(make(noise=False)))[0] - want[0]) > 1e-3  # the noise did act


def test_a_plain_model_keeps_keras_own_dropout():
    """No distribution: Keras' own stateless draw (tfdist does not change code it does not distribute)."""
    from keras.src.backend.tensorflow import random as tf_random

    from tfdist import _patches

    original = _patches.original("keras.src.backend.tensorflow.random:dropout")
    x = tf.ones((64, 64))
    got = keras.random.dropout(x, 0.5, seed=keras.random.SeedGenerator(3))
    want = original(x, 0.5, None, keras.random.SeedGenerator(3))
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert tf_random.dropout is not original  # the row is installed; it hands this call to Keras
