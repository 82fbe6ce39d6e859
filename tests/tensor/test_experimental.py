"""local_map and register_sharding, against numpy and with collective counts."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_mesh
from reference import assert_dtensor_equal
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.experimental import local_map, register_sharding

MESH = make_mesh((2, 4))
X = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)


def row_sums(t):
    return tf.reduce_sum(t, axis=1, keepdims=True)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_local_map_partial_output_equals_global_sum(graph):
    x = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    f = local_map(row_sums, [Shard(0), Partial()])
    if graph:
        f = tf.function(f)
        f(x)
    with CommDebugMode() as comm:
        y = f(x)
    assert comm.get_total_counts() == 0  # the local views move no data
    assert y.placements == (Shard(0), Partial())
    np.testing.assert_allclose(y.numpy(), X.sum(1, keepdims=True))


def test_local_map_sees_exactly_the_local_shards():
    x = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    y = local_map(row_sums, [Shard(0), Shard(1)])(x)
    # device (dp, tp) summed rows 4dp..4dp+3 of columns 3tp..3tp+2
    want = X.reshape(8, 4, 3).sum(2)
    assert_dtensor_equal(want, (Shard(0), Shard(1)), y)


def test_local_map_megatron_rowwise_matmul_and_replicated_capture():
    x = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    w_np = np.arange(12 * 5, dtype=np.float32).reshape(12, 5) / 10
    w = distribute_tensor(w_np, MESH, [Replicate(), Shard(0)])
    b = distribute_tensor(np.ones(5, np.float32), MESH, [Replicate(), Replicate()])
    f = tf.function(local_map(lambda a, w, b: a @ w + b / 4.0, [Shard(0), Partial()]))
    y = f(x, w, b)
    np.testing.assert_allclose(y.numpy(), X @ w_np + 1.0, rtol=1e-5)


def test_local_map_as_a_decorator_is_the_same_function():
    """torch's ``@local_map(out_placements=..., ...)``: func omitted, the rest given by keyword."""
    @local_map(out_placements=[Shard(0), Partial()], in_placements=[[Shard(0), Shard(1)]], device_mesh=MESH)
    def sums(t):
        return row_sums(t)

    y = sums(distribute_tensor(X, MESH, [Shard(0), Shard(1)]))
    assert y.placements == (Shard(0), Partial())
    np.testing.assert_allclose(y.numpy(), X.sum(1, keepdims=True))


def test_local_map_in_placements_and_redistribute_inputs():
    x = distribute_tensor(X, MESH, [Shard(0), Replicate()])
    f = local_map(lambda t: t * 2.0, [Shard(0), Shard(1)], in_placements=[[Shard(0), Shard(1)]])
    with pytest.raises(ValueError, match="redistribute_inputs=True"):
        f(x)
    g = local_map(lambda t: t * 2.0, [Shard(0), Shard(1)], in_placements=[[Shard(0), Shard(1)]],
                  redistribute_inputs=True)
    assert_dtensor_equal(2 * X, (Shard(0), Shard(1)), g(x))


def test_local_map_multiple_outputs_and_plain_call():
    x = distribute_tensor(X, MESH, [Shard(0), Replicate()])
    f = local_map(lambda t: (t + 1.0, tf.reduce_max(t, axis=0, keepdims=True)),
                  [[Shard(0), Replicate()], [Partial("max"), Replicate()]])
    a, m = f(x)
    assert_dtensor_equal(X + 1, (Shard(0), Replicate()), a)
    np.testing.assert_array_equal(m.numpy(), X.max(0, keepdims=True))
    plain = f(tf.ones((2, 2)))  # no DTensor in: a plain call
    np.testing.assert_array_equal(plain[0].numpy(), np.full((2, 2), 2.0))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_local_map_gradients_under_a_tape_equal_one_device(graph):
    """Transposes and full reductions in the local function: under an eager tape their backward
    needs the inverse permutation and the kept shape as constants, which a separate backward
    function does not have (TF DTensor refused it; now one traced vjp program)."""
    rng = np.random.default_rng(1)
    x_np = rng.normal(size=(8, 6)).astype(np.float32)
    w_np = rng.normal(size=(6, 4)).astype(np.float32)
    x = distribute_tensor(x_np, MESH, [Shard(0), Replicate()])
    w = distribute_tensor(w_np, MESH, [Replicate(), Shard(1)])
    f = local_map(lambda a, b: (tf.tanh(tf.transpose(tf.transpose(a)) @ b), tf.reduce_sum(tf.transpose(a))),
                  [[Shard(0), Shard(1)], [Partial(), Replicate()]])

    def run(xp, wp):
        with tf.GradientTape() as tape:
            tape.watch([xp, wp])
            y, s = f(DTensor._wrap(xp, x._spec), DTensor._wrap(wp, w._spec))
            loss = tf.reduce_sum(y ** 2) + tf.reduce_sum(s ** 2)
        return loss, tape.gradient(loss, [xp, wp])

    if graph:
        run = tf.function(run)
    loss, (dx, dw) = run(x._physical, w._physical)
    xr, wr = tf.constant(x_np), tf.constant(w_np)
    with tf.GradientTape() as tape:  # one device
        tape.watch([xr, wr])
        want = tf.reduce_sum(tf.tanh(xr @ wr) ** 2) + tf.reduce_sum(xr) ** 2
    want_dx, want_dw = tape.gradient(want, [xr, wr])
    np.testing.assert_allclose(float(loss.numpy()), want.numpy(), rtol=1e-5)
    np.testing.assert_allclose(DTensor._wrap(dx, x._spec).numpy(), want_dx.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(DTensor._wrap(dw, w._spec).numpy(), want_dw.numpy(), rtol=1e-4, atol=1e-5)


def test_local_map_uneven_shards_gradient_under_an_eager_tape_equals_one_device():
    """The per-device form (uneven shards): the copies of an input along a Replicate mesh dim share one
    gradient, as torch's ``to_local()`` reads it in local_map (it was summed over the 2 copies: 2x)."""
    x_np = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    u = distribute_tensor(x_np, MESH, [Replicate(), Shard(0)])  # 6 rows over 4 devices: 2, 2, 1, 1
    f = local_map(lambda t: tf.tanh(tf.transpose(t)), [Replicate(), Shard(1)])
    xp = u._physical
    with tf.GradientTape() as tape:
        tape.watch(xp)
        loss = tf.reduce_sum(f(DTensor._wrap(xp, u._spec)) ** 2)
    grad = DTensor._wrap(tape.gradient(loss, xp), u._spec)
    xr = tf.constant(x_np)
    with tf.GradientTape() as tape:  # one device
        tape.watch(xr)
        want = tf.reduce_sum(tf.tanh(tf.transpose(xr)) ** 2)
    np.testing.assert_allclose(float(loss.numpy()), want.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grad.full_tensor().numpy(), tape.gradient(want, xr).numpy(), rtol=1e-5, atol=1e-6)


def test_local_map_bad_input():
    u = distribute_tensor(np.ones((6, 4), np.float32), MESH, [Replicate(), Shard(0)])
    # uneven shards run per device eagerly (exact), and are refused inside a tf.function, saying why
    sums = local_map(row_sums, [Replicate(), Shard(0)])(u)
    np.testing.assert_array_equal(sums.full_tensor().numpy(), np.full((6, 1), 4.0))
    with pytest.raises(ValueError, match="runs per device, eagerly"):
        tf.function(local_map(row_sums, [Replicate(), Shard(0)]))(u)
    x = distribute_tensor(X, MESH, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="one entry per output"):
        local_map(lambda t: (t, t), [Shard(0), Replicate()])(x)
    with pytest.raises(TypeError, match="func must be callable"):
        local_map(3, [Replicate()])


def test_register_sharding_adds_an_op_and_picks_the_cheapest():
    @register_sharding(tf.math.cumsum)
    def cumsum_strategy(x, axis=0, exclusive=False, reverse=False, name=None):
        scan = axis % x.ndim
        options = [(Replicate(), [Replicate(), None])]
        options += [(Shard(d), [Shard(d), None]) for d in range(x.ndim) if d != scan]
        return options

    x = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    with CommDebugMode() as comm:
        y = tf.math.cumsum(x, 1)
    # dp keeps Shard(0) for free; tp must give up the scanned dim: one gather
    assert_dtensor_equal(np.cumsum(X, 1), (Shard(0), Replicate()), y)
    assert comm.get_total_counts() == 1
    y0 = tf.function(lambda t: tf.math.cumsum(t, 0))(x)
    assert_dtensor_equal(np.cumsum(X, 0), (Replicate(), Shard(1)), y0)


def test_register_sharding_overrides_a_builtin_rule():
    from tfdist.tensor import _dispatch

    @register_sharding(tf.nn.softmax)
    def replicate_only(logits, axis=None):
        return [(Replicate(), [Replicate()])]

    try:
        x = distribute_tensor(X / 50, MESH, [Shard(0), Replicate()])
        y = tf.nn.softmax(x)
        assert y.placements == (Replicate(), Replicate())
        e = np.exp(X / 50 - (X / 50).max(1, keepdims=True))
        np.testing.assert_allclose(y.numpy(), e / e.sum(1, keepdims=True), rtol=1e-5)
    finally:
        del _dispatch.CUSTOM_STRATEGIES[tf.nn.softmax]
    assert tf.nn.softmax(x).placements == (Shard(0), Replicate())  # built-in rule again


def test_register_sharding_with_a_partial_output_runs_on_local_shards():
    """torch's contraction split: A sharded on its columns and B on its rows over tp give each device a
    partial product; the strategy says Partial, the op runs per device (no collective), and the sum of
    the partials is A @ B."""
    from tfdist.tensor import _dispatch

    @register_sharding(tf.linalg.matmul)
    def contraction(a, b, *rest, **kwargs):
        none = [None] * len(rest)
        return [(Replicate(), [Replicate(), Replicate(), *none]),
                (Partial(), [Shard(1), Shard(0), *none])]

    a_np, b_np = X[:, :8], X[:8, :4] / 10
    try:
        a = distribute_tensor(a_np, MESH, [Replicate(), Shard(1)])
        b = distribute_tensor(b_np, MESH, [Replicate(), Shard(0)])
        with CommDebugMode() as comm:
            y = tf.linalg.matmul(a, b)
        assert y.placements == (Replicate(), Partial()) and comm.get_total_counts() == 0
        parts = [t.numpy() for t in y.local_tensors()]
        for i, part in enumerate(parts):  # device i holds tp block i // ... of the contraction
            k = i % 4
            np.testing.assert_allclose(part, a_np[:, 2 * k:2 * k + 2] @ b_np[2 * k:2 * k + 2], rtol=1e-6)
        np.testing.assert_allclose(y.full_tensor().numpy(), a_np @ b_np, rtol=1e-5)
    finally:
        del _dispatch.CUSTOM_STRATEGIES[tf.linalg.matmul]
