"""Keras' jit_compile on a CPU mesh: a data-parallel model's forward as one XLA program per device.

The reference is the same model trained by Keras on one device with the same jit_compile (no
distribution, no tfdist in its step); the programs are checked for the XlaCallModule ops that hold
the compiled forward and backward (tfdist/keras/_compiled_forward.py)."""

from __future__ import annotations

import collections
import warnings

import keras
import numpy as np
import pytest

import tfdist.keras  # noqa: F401  (the Keras plug-in)
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.keras import _data
from tfdist.keras._trainer import mesh_of

RNG = np.random.default_rng(0)
X = RNG.standard_normal((70, 16)).astype(np.float32)  # 4 batches of 16 (2 rows a device), then 6 rows each device computes whole
Y = RNG.standard_normal((70, 8)).astype(np.float32)
LR = 0.1


def _mlp(*middle):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="gelu", name="up"), *middle,
                             keras.layers.Dense(8, name="down")])


def _data_parallel():
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        device_mesh=keras.distribution.DeviceMesh((8,), ["batch"])))


def _one_device(*middle, jit_compile=True):
    model = _mlp(*middle)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=jit_compile)
    losses = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]
    return model, losses


def _fit(model, jit_compile):
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=jit_compile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]
    return losses, [str(w.message) for w in caught if "jit_compile" in str(w.message)]


def _train_program_ops(model) -> collections.Counter:
    mesh, batch_axis = mesh_of(model)
    data = _data.shard_batch((X[:16], Y[:16]), mesh, batch_axis)
    graph = model.train_function.one_step.traced[0].get_concrete_function(data).graph
    return collections.Counter(op.type for op in graph.get_operations())


def test_data_parallel_forward_and_backward_compile_per_device_and_train_like_one_device():
    reference, ref_losses = _one_device()
    _data_parallel()
    model = _mlp()
    losses, said = _fit(model, jit_compile=True)
    assert said == []
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ops = _train_program_ops(model)
    # the forward and its gradient: one module each; their matmuls and gelu are inside them
    assert ops["XlaCallModule"] == 2 and not ops["MatMul"] and not ops["Erf"]
    np.testing.assert_allclose(model.predict(X, verbose=0), reference.predict(X, verbose=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(X, Y, verbose=0), reference.evaluate(X, Y, verbose=0), rtol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, "auto"])
def test_without_jit_compile_the_step_is_tf_ops(jit_compile):
    _data_parallel()
    model = _mlp()
    _, said = _fit(model, jit_compile=jit_compile)
    ops = _train_program_ops(model)
    assert said == [] and ops["XlaCallModule"] == 0 and ops["MatMul"] > 0
    if jit_compile == "auto":  # Keras' rule on a host without accelerators, on a mesh as on one device
        assert model.jit_compile is False


def test_a_forward_that_updates_state_runs_as_tf_ops_and_says_why():
    # batch normalisation's moving statistics see the whole batch on one device
    reference, ref_losses = _one_device(keras.layers.BatchNormalization(name="bn"))
    _data_parallel()
    model = _mlp(keras.layers.BatchNormalization(name="bn"))
    losses, said = _fit(model, jit_compile=True)
    assert len(said) == 1 and "updates non-trainable variables ['sequential" in said[0] and "bn/" in said[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert _train_program_ops(model)["XlaCallModule"] == 0


def test_sharded_variables_run_as_tf_ops_and_say_which():
    _, ref_losses = _one_device()
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*down/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = _mlp()
    losses, said = _fit(model, jit_compile=True)
    assert len(said) == 1 and "are sharded over the mesh" in said[0] and "up/kernel" in said[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

