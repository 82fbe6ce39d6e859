"""Keras train and test steps on a mesh send their independent all-reduces as one (TF DTensor's
combine pass, enabled by tfdist only while it expands those programs: tfdist/_runtime.py); every
other DTensor program in the process keeps one all-reduce per reduction.  References: the same
fit on one device, numpy, and the collectives TF executed (partition graphs)."""

from __future__ import annotations

import collections

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist.keras  # noqa: F401  (the Keras plug-in)
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.tensor.debug._executed import partition_graphs

RNG = np.random.default_rng(3)
X = RNG.standard_normal((64, 16)).astype(np.float32)
Y = RNG.standard_normal((64, 8)).astype(np.float32)


def _mlp(depth: int = 3):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((16,))]
    layers += [keras.layers.Dense(16, activation="tanh", name=f"hidden{i}") for i in range(depth)]
    return keras.Sequential(layers + [keras.layers.Dense(8, name="out")], name="combined_mlp")


def _collectives_per_device(run, scope: str) -> collections.Counter:
    """Collective kernels of CPU:0's share of the programs TF instantiated while ``run()`` ran
    and that hold a node of name scope ``scope`` (TF's run metadata may hold earlier tests' too)."""
    graphs = [g for g in partition_graphs(run) if any(scope in node.name for node in g.node)]
    return collections.Counter(node.op for graph in graphs for node in graph.node
                               if node.op.startswith("Collective") and node.device.endswith("CPU:0"))


def _fit(model, epochs: int = 2):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model.fit(X, Y, batch_size=16, epochs=epochs, verbose=0, shuffle=False)


def test_fit_sends_the_replicated_gradients_in_one_all_reduce_and_trains_like_one_device():
    keras.distribution.set_distribution(None)
    reference = _mlp()
    ref_history = _fit(reference)

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = _mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    counts = _collectives_per_device(
        lambda: model.fit(X[:16], Y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False), "combined_mlp")
    # 8 gradients (4 kernels, 4 biases), each a sum over the batch: one all-reduce for all of
    # them, one for the mean loss (a Mean all-reduce, which TF keeps apart from the sums)
    assert counts["CollectiveReduceV2"] == 2, counts
    keras.distribution.set_distribution(None)

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = _mlp()
    history = _fit(model)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_evaluate_matches_one_device_with_its_reductions_combined():
    keras.distribution.set_distribution(None)
    reference = _mlp()
    reference.compile(loss="mse", metrics=["mae"])
    want = reference.evaluate(X, Y, batch_size=16, verbose=0)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = _mlp()
    model.compile(loss="mse", metrics=["mae"])
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=16, verbose=0), want, rtol=1e-5)


class _ReportsBatchSums(keras.Model):
    """A train step that returns values reduced over the batch itself: TF DTensor cannot
    combine a program that returns an all-reduced value, so this step is expanded uncombined."""

    def train_step(self, data):
        x, y = data
        logs = super().train_step(data)
        return {**logs, "x_sum": tf.reduce_sum(x), "y_sum": tf.reduce_sum(y)}


def test_a_step_that_returns_all_reduced_values_runs_uncombined_with_the_right_values():
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    inputs = keras.Input((16,))
    model = _ReportsBatchSums(inputs, keras.layers.Dense(8, name="out")(keras.layers.Dense(16)(inputs)),
                              name="reports_batch_sums")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    history = model.fit(X[:16], Y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(history.history["x_sum"], [X[:16].sum()], rtol=1e-5)
    np.testing.assert_allclose(history.history["y_sum"], [Y[:16].sum()], rtol=1e-5)


def test_plain_dtensor_functions_in_the_same_process_are_not_combined():
    """After a combined fit step, an eager tape over a tf.function whose backward returns two
    all-reduced gradients -- the program TF's combine pass cannot compile
    (docs/tf_dtensor_repros/combined_all_reduce_returned_without_layout.py) -- still works, with
    one all-reduce per gradient."""
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    _fit(_mlp(), epochs=1)
    keras.distribution.set_distribution(None)

    mesh = dtensor.create_mesh([("dp", 8)], device_type="CPU")
    replicated = dtensor.Layout.replicated(mesh, 2)
    w1, w2 = (dtensor.DVariable(dtensor.call_with_layout(tf.fill, replicated, dims=(8, 4), value=scale))
              for scale in (1.0, 0.05))
    x = dtensor.call_with_layout(tf.ones, dtensor.Layout.batch_sharded(mesh, "dp", 2), shape=(16, 8))

    @tf.function
    def loss_fn(x):
        with tf.name_scope("plain_probe"):  # the scope the collectives are counted by
            return tf.reduce_sum(x @ w1) + tf.reduce_sum(tf.tanh(x @ w2))

    def gradients():
        with tf.GradientTape() as tape:
            loss = loss_fn(x)
        return tape.gradient(loss, [w1, w2])

    counts = _collectives_per_device(gradients, "plain_probe")
    g1, g2 = gradients()
    # d/dw1 of sum(x @ w1) over 16 rows of ones: 16 in every entry; d/dw2: 16 (1 - tanh(0.4)^2)
    np.testing.assert_allclose(dtensor.unpack(g1)[0].numpy(), np.full((8, 4), 16.0))
    np.testing.assert_allclose(dtensor.unpack(g2)[0].numpy(), np.full((8, 4), 16 * (1 - np.tanh(0.4) ** 2)),
                               rtol=1e-5)
    # the forward's two batch sums stay partial through their add and leave in one all-reduce; the
    # backward sends the two gradients apart (combined they would be one, or fail to compile)
    assert counts["CollectiveReduceV2"] == 3, counts


def test_large_gradients_keep_their_own_all_reduces():
    """Packing copies every gradient into one buffer: for a few large gradients that costs more
    than the all-reduces it saves (W1's 1024-wide MLP: 1.2-1.4x slower combined), so such a step
    keeps one all-reduce per gradient; many small ones are packed (keras/_trainer.combining_pays)."""
    from tfdist.keras._trainer import combining_pays

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(0)
    wide = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, name="up"),
                             keras.layers.Dense(512, name="down")], name="wide_mlp")
    assert not combining_pays(wide)  # 4 gradients, 4 MB on every device
    wide.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = RNG.standard_normal((16, 512)).astype(np.float32)
    counts = _collectives_per_device(lambda: wide.fit(x, x, batch_size=16, epochs=1, verbose=0), "wide_mlp")
    assert counts["CollectiveReduceV2"] == 5, counts  # 4 gradients + the mean loss
