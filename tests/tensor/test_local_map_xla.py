"""local_map(..., jit_compile=True): one XLA program per device inside a TF DTensor program.

References are the single-device computation with plain TensorFlow on the global arrays (values and
gradients), and numpy for the reductions; the programs are checked to hold the XlaCallModule op
(compiled) or not (TF ops)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_mesh
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor import _xla_local
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.experimental import _local_map, local_map

MESH = make_mesh((2, 4))
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 8)).astype(np.float32)
W = RNG.normal(size=(8, 12)).astype(np.float32)


def _block(a, b):
    return tf.tanh(a @ b), tf.reduce_sum(a, axis=1)


def _reference():
    """Loss sum(tanh(XW)^2) + sum(rowsum(X)^2) and its gradients, on one device."""
    x, w = tf.constant(X), tf.constant(W)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        loss = tf.reduce_sum(tf.tanh(x @ w) ** 2) + tf.reduce_sum(tf.reduce_sum(x, 1) ** 2)
    return loss.numpy(), [g.numpy() for g in tape.gradient(loss, [x, w])]


def _ops(function, *args) -> set[str]:
    return {op.type for op in function.get_concrete_function(*args).graph.get_operations()}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_values_and_gradients_equal_one_device(graph):
    # x varies over dp only, w over tp only: each device's gradient of x is summed over tp,
    # of w over dp, by TF DTensor
    x = distribute_tensor(X, MESH, [Shard(0), Replicate()])
    w = distribute_tensor(W, MESH, [Replicate(), Shard(1)])
    f = local_map(_block, [[Shard(0), Shard(1)], [Shard(0), Replicate()]], jit_compile=True)

    def run(xp, wp):
        with tf.GradientTape() as tape:
            tape.watch([xp, wp])
            y, s = f(DTensor._wrap(xp, x._spec), DTensor._wrap(wp, w._spec))
            loss = tf.reduce_sum(y ** 2) + tf.reduce_sum(s ** 2)
        return y, s, loss, tape.gradient(loss, [xp, wp])

    if graph:
        run = tf.function(run)
    y, s, loss, (dx, dw) = run(x._physical, w._physical)
    want_loss, (want_dx, want_dw) = _reference()
    assert y.placements == (Shard(0), Shard(1)) and s.placements == (Shard(0), Replicate())
    np.testing.assert_allclose(y.numpy(), np.tanh(X @ W), atol=1e-6)
    np.testing.assert_allclose(s.numpy(), X.sum(1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(loss.numpy()), want_loss, rtol=1e-5)
    np.testing.assert_allclose(DTensor._wrap(dx, x._spec).numpy(), want_dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(DTensor._wrap(dw, w._spec).numpy(), want_dw, rtol=1e-4, atol=1e-5)


def test_the_program_holds_one_compiled_module_and_no_vectorised_map():
    x = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    compiled = tf.function(local_map(lambda t: tf.nn.gelu(t) * 2.0, [Shard(0), Shard(1)], jit_compile=True))
    vectorised = tf.function(local_map(lambda t: tf.nn.gelu(t) * 2.0, [Shard(0), Shard(1)]))
    ops = _ops(compiled, x)
    assert "XlaCallModule" in ops and "Erf" not in ops  # gelu lives inside the module
    assert "XlaCallModule" not in _ops(vectorised, x)
    np.testing.assert_allclose(compiled(x).numpy(), vectorised(x).numpy(), rtol=1e-6, atol=1e-6)


def test_partial_output_and_the_views_move_no_data():
    x = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    f = tf.function(local_map(lambda t: tf.reduce_sum(t, axis=1, keepdims=True), [Shard(0), Partial()],
                              jit_compile=True))
    f(x)
    with CommDebugMode() as comm:
        y = f(x)
    assert comm.get_total_counts() == 0
    assert y.placements == (Shard(0), Partial())
    np.testing.assert_allclose(y.numpy(), X.sum(1, keepdims=True), rtol=1e-5)


def test_replicated_inputs_and_a_plain_tensor_argument():
    # nothing varies by device: every device runs the same module, the output is replicated
    w = distribute_tensor(W, MESH, [Replicate(), Replicate()])
    f = local_map(lambda a, b: a @ b, [Replicate(), Replicate()], jit_compile=True)
    y = f(distribute_tensor(X[:8], MESH, [Replicate(), Replicate()]), w)
    np.testing.assert_allclose(y.numpy(), X[:8] @ W, rtol=1e-5)
    x = distribute_tensor(X, MESH, [Shard(0), Replicate()])
    scale = tf.constant(3.0)
    g = local_map(lambda a, c: a * c, [Shard(0), Replicate()], jit_compile=True)
    np.testing.assert_allclose(g(x, scale).numpy(), 3.0 * X, rtol=1e-6)


def test_the_platform_follows_the_mesh_device_type(monkeypatch):
    assert _xla_local.xla_platform("cpu") == "CPU"
    assert _xla_local.xla_platform("GPU") == ("ROCM" if tf.test.is_built_with_rocm() else "CUDA")
    assert _xla_local.xla_platform("tpu") is None  # TF DTensor compiles TPU programs with XLA itself
    # a mesh type with no platform (TPU) keeps the vectorised TF-op form
    seen = []
    monkeypatch.setattr(_local_map, "xla_platform", lambda kind: seen.append(kind))
    x = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    f = tf.function(local_map(lambda t: t * 2.0, [Shard(0), Shard(1)], jit_compile=True))
    assert "XlaCallModule" not in _ops(f, x) and seen == ["cpu"]


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="jit_compile must be True or False. Received: jit_compile='yes'"):
        local_map(lambda t: t, [Shard(0), Replicate()], jit_compile="yes")
    x = distribute_tensor(X, MESH, [Shard(0), Replicate()])

    @tf.function
    def captures(x, other):
        return local_map(lambda t: t * other, [Shard(0), Replicate()], jit_compile=True)(x)

    with pytest.raises(ValueError, match="captures tensors or variables of the enclosing program"):
        captures(x, tf.constant(2.0))


def test_uneven_shards_run_compiled_per_device_eagerly():
    u = distribute_tensor(np.arange(24.0, dtype=np.float32).reshape(6, 4), MESH, [Replicate(), Shard(0)])
    sums = local_map(lambda t: tf.reduce_sum(t, axis=1, keepdims=True), [Replicate(), Shard(0)],
                     jit_compile=True)(u)
    np.testing.assert_array_equal(sums.full_tensor().numpy(), np.arange(24.0).reshape(6, 4).sum(1, keepdims=True))


def test_an_op_xla_cannot_compile_is_named():
    x = distribute_tensor(np.ones((8, 4, 4, 2), np.float32), MESH, [Shard(0), Replicate()])
    f = local_map(lambda t: tf.image.resize(t, [8, 8], method="bicubic"), [Shard(0), Replicate()], jit_compile=True)
    with pytest.raises(ValueError, match="XLA cannot compile the local function.*ResizeBicubic"):
        f(x)

