"""The framework seam: parallelize_module and fully_shard on plain tf.Modules (tests/tfmodule_backend.py).

Nothing in tfdist.tensor or tfdist.fsdp knows this framework; the reference is numpy on
the weights the modules were made with.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
from tfdist.fsdp import fully_shard
from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tfmodule_backend import Linear, Sequential

BATCH, D_IN, HIDDEN, D_OUT = 8, 16, 32, 8
LR = 0.1


def _model() -> Sequential:
    return Sequential("mlp", [Linear("up", D_IN, HIDDEN, activation=tf.nn.relu, seed=1), Linear("down", HIDDEN, D_OUT, seed=2)])


def _numpy_weights(model: Sequential) -> list[np.ndarray]:
    return [np.array(model.layers[i].params()[n].var.numpy()) for i in (0, 1) for n in ("kernel", "bias")]


def _numpy_step(w: list[np.ndarray], x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, float, list[np.ndarray]]:
    """Forward, mean-squared-error loss and one SGD step, by hand."""
    k1, b1, k2, b2 = (a.astype(np.float64) for a in w)
    h_pre = x @ k1 + b1
    h = np.maximum(h_pre, 0)
    y = h @ k2 + b2
    loss = float(np.mean((y - t) ** 2))
    dy = 2 * (y - t) / y.size
    dk2, db2 = h.T @ dy, dy.sum(0)
    dh = dy @ k2.T * (h_pre > 0)
    dk1, db1 = x.T @ dh, dh.sum(0)
    return y, loss, [a - LR * g for a, g in zip((k1, b1, k2, b2), (dk1, db1, dk2, db2))]


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, D_IN)).astype(np.float32), rng.normal(size=(BATCH, D_OUT)).astype(np.float32)


def _train_step(model: Sequential, mesh: tfdist.DeviceMesh, x: np.ndarray, t: np.ndarray):
    """One SGD step of the distributed model, traced (as a user's training loop would be)."""
    tf_mesh = mesh.root_mesh.to_tf()
    batch = dtensor.Layout.batch_sharded(tf_mesh, mesh.root_mesh.axis_names[0], 2)
    xs, ts = dtensor.copy_to_mesh(x, dtensor.Layout.replicated(tf_mesh, 2)), dtensor.copy_to_mesh(t, dtensor.Layout.replicated(tf_mesh, 2))
    xs, ts = dtensor.relayout(xs, batch), dtensor.relayout(ts, batch)
    variables = [p.var for layer in model.layers for p in layer.params().values()]

    @tf.function
    def step(xs, ts):
        with tf.GradientTape() as tape:
            y = model(xs)
            loss = tf.reduce_mean(tf.square(y - ts))
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(LR * g)
        return y, loss

    y, loss = step(xs, ts)
    return dtensor.relayout(y, dtensor.Layout.replicated(tf_mesh, 2)), loss, variables


def _full(v) -> np.ndarray:
    value = tf.convert_to_tensor(v)
    return dtensor.relayout(value, dtensor.Layout.replicated(dtensor.fetch_layout(value).mesh, value.shape.rank)).numpy()


def _check_step(model, mesh, before):
    x, t = _data()
    y_ref, loss_ref, after_ref = _numpy_step(before, x, t)
    y, loss, variables = _train_step(model, mesh, x, t)
    np.testing.assert_allclose(_full(y), y_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_full(loss), loss_ref, rtol=1e-4)
    for v, ref in zip(variables, after_ref):
        np.testing.assert_allclose(_full(v), ref, rtol=1e-4, atol=1e-5)


def test_parallelize_module_on_a_second_framework(mesh_2d):
    model = _model()
    before = _numpy_weights(model)
    parallelize_module(model, mesh_2d["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    up, down = model.layers
    assert list(up.kernel.var.layout.sharding_specs) == [dtensor.UNSHARDED, "tp"]
    assert list(up.bias.var.layout.sharding_specs) == ["tp"]
    assert list(down.kernel.var.layout.sharding_specs) == ["tp", dtensor.UNSHARDED]
    assert list(down.bias.var.layout.sharding_specs) == [dtensor.UNSHARDED]
    x, _ = _data()
    y_ref = _numpy_step(before, x, np.zeros((BATCH, D_OUT), np.float32))[0]
    np.testing.assert_allclose(_full(model(tf.constant(x))), y_ref, rtol=1e-4, atol=1e-5)  # eager call
    _check_step(model, mesh_2d, before)


def test_fully_shard_on_a_second_framework(mesh_1d):
    model = _model()
    before = _numpy_weights(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh_1d)
    fully_shard(model, mesh=mesh_1d)
    assert isinstance(model, tfdist.fsdp.FSDPModule) and isinstance(model, Sequential)
    for layer in model.layers:
        assert list(layer.kernel.var.layout.sharding_specs) == ["x", dtensor.UNSHARDED]
    _check_step(model, mesh_1d, before)


def test_an_object_no_backend_serves_is_refused_by_name():
    with pytest.raises(TypeError, match="parallelize_module.*int"):
        parallelize_module(3, tfdist.init_device_mesh("cpu", (8,)), ColwiseParallel())
