"""TF ops on DTensors: values against numpy, placements against the rules."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_mesh
from reference import assert_dtensor_equal
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode

MESH = make_mesh((2, 4))
MESH_42 = make_mesh((4, 2))
RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def both_modes(fn):
    """Runs ``fn`` eagerly and as a tf.function; returns both results."""
    return fn(), tf.function(fn)()


def test_seed_matmul_fully_replicated():
    a_np = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    b_np = np.array([[6, 5], [4, 3], [2, 1]], np.float32)
    a = distribute_tensor(a_np, MESH, [Replicate(), Replicate()])
    b = distribute_tensor(b_np, MESH, [Replicate(), Replicate()])
    c = tf.matmul(a, b)
    assert_dtensor_equal(np.array([[20, 14], [56, 41]], np.float32), (Replicate(), Replicate()), c)


def test_seed_matmul_contraction_sharded_gives_partial_result():
    # Seed 004 on 6 devices shards K=3 over x=3; here K=4 over dp=4 of a 4x2 mesh.
    a_np, b_np = rand(2, 4), rand(4, 2)
    a = distribute_tensor(a_np, MESH_42, [Shard(1), Replicate()])
    b = distribute_tensor(b_np, MESH_42, [Shard(0), Replicate()])
    # each device multiplies a 2x1 block by a 1x2 block: a quarter of the work,
    # and the sum of the four products stays pending, as torch's Partial
    assert tuple(a.to_local().shape) == (2, 1) and tuple(b.to_local().shape) == (1, 2)
    for c in both_modes(lambda: tf.matmul(a, b)):
        assert_dtensor_equal(a_np @ b_np, (Partial(), Replicate()), c, rtol=1e-5)
    with CommDebugMode() as comm:
        tf.matmul(a, b)
    assert comm.get_comm_counts() == {}


def test_seed_matmul_extra_sharding_carries_to_result():
    a_np, b_np = rand(2, 4), rand(4, 2)
    a = distribute_tensor(a_np, MESH_42, [Shard(1), Shard(0)])  # layout ['y', 'x']
    b = distribute_tensor(b_np, MESH_42, [Shard(0), Replicate()])
    for c in both_modes(lambda: tf.matmul(a, b)):
        assert_dtensor_equal(a_np @ b_np, (Partial(), Shard(0)), c, rtol=1e-5)


@pytest.mark.parametrize("pa, pb, out", [
    ((Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(1))),   # rows x cols
    ((Replicate(), Shard(1)), (Replicate(), Shard(0)), (Replicate(), Partial())),  # contraction: Partial
    ((Shard(0), Shard(1)), (Replicate(), Replicate()), (Shard(0), Partial())),  # b sliced to match
    ((Replicate(), Replicate()), (Shard(1), Replicate()), (Shard(1), Replicate())),
])
def test_matmul_rules(pa, pb, out):
    a_np, b_np = rand(6, 8), rand(8, 12)
    a = distribute_tensor(a_np, MESH, pa)
    b = distribute_tensor(b_np, MESH, pb)
    for c in both_modes(lambda: a @ b):
        assert_dtensor_equal(a_np @ b_np, out, c, rtol=1e-4, atol=1e-5)


def test_matmul_uneven_and_transposed_and_batched():
    a_np, b_np = rand(7, 8), rand(5, 8)  # 7 rows and 5 cols are uneven on 2 and 4
    a = distribute_tensor(a_np, MESH, [Shard(0), Replicate()])
    b = distribute_tensor(b_np, MESH, [Replicate(), Shard(0)])
    c = tf.matmul(a, b, transpose_b=True)
    assert_dtensor_equal(a_np @ b_np.T, (Shard(0), Shard(1)), c, rtol=1e-4, atol=1e-5)
    # uneven contraction dim: gathered first, never summed over padding
    a2 = distribute_tensor(rand(4, 6), MESH, [Replicate(), Shard(1)])
    b2 = distribute_tensor(rand(6, 3), MESH, [Replicate(), Shard(0)])
    np.testing.assert_allclose((a2 @ b2).numpy(), a2.numpy() @ b2.numpy(), rtol=1e-5)
    x_np, w_np = rand(4, 6, 8), rand(4, 8, 3)
    x = distribute_tensor(x_np, MESH, [Shard(0), Shard(2)])
    w = distribute_tensor(w_np, MESH, [Shard(0), Shard(1)])
    assert_dtensor_equal(x_np @ w_np, (Shard(0), Partial()), x @ w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("xs, ws, px, pw, out", [
    ((2, 8, 16), (16, 4), (Replicate(), Shard(2)), (Replicate(), Shard(0)), (Replicate(), Partial())),
    ((2, 8, 16), (16, 4), (Shard(0), Shard(2)), (Replicate(), Shard(0)), (Shard(0), Partial())),
    ((8, 16), (3, 16, 4), (Replicate(), Shard(1)), (Shard(0), Shard(1)), (Shard(0), Partial())),
    ((2, 3, 8, 16), (3, 16, 4), (Shard(1), Shard(3)), (Replicate(), Shard(1)), (Shard(1), Partial())),
], ids=["dense-on-3d", "dp-and-row-parallel", "batch-on-b", "4d-by-3d"])
def test_broadcast_batched_matmul_over_a_sharded_contraction_is_partial(xs, ws, px, pw, out):
    """torch: [b, s, k] @ [k, n] with k sharded is Partial, no communication (a row-parallel
    Dense on a 3-D input); the batch dims of the shorter operand broadcast."""
    x_np, w_np = rand(*xs), rand(*ws)
    x = distribute_tensor(x_np, MESH, px)
    w = distribute_tensor(w_np, MESH, pw)
    with CommDebugMode() as comm:
        y = x @ w
    assert comm.get_comm_counts() == {}
    for c in [y] + list(both_modes(lambda: x @ w)):
        assert_dtensor_equal(x_np @ w_np, out, c, rtol=1e-4, atol=1e-5)


def test_elementwise_broadcast_and_scalars():
    x_np, bias_np = rand(7, 8), rand(8)
    x = distribute_tensor(x_np, MESH, [Shard(0), Shard(1)])
    bias = distribute_tensor(bias_np, MESH, [Replicate(), Replicate()])
    for y in both_modes(lambda: tf.nn.relu(x * 2.0 + bias) - 1):
        assert_dtensor_equal(np.maximum(x_np * 2 + bias_np, 0) - 1, (Shard(0), Shard(1)), y, rtol=1e-5)
    assert_dtensor_equal(1.0 / (np.abs(x_np) + 1), (Shard(0), Shard(1)), 1.0 / (abs(x) + 1), rtol=1e-5)
    assert_dtensor_equal(-x_np, (Shard(0), Shard(1)), -x)
    assert_dtensor_equal(np.exp(x_np), (Shard(0), Shard(1)), tf.exp(x), rtol=1e-5)
    assert tf.cast(x, tf.float64).dtype == tf.float64


def test_elementwise_conflicting_placements_are_resolved():
    a_np, b_np = rand(8, 8), rand(8, 8)
    a = distribute_tensor(a_np, MESH, [Shard(0), Replicate()])
    b = distribute_tensor(b_np, MESH, [Shard(1), Shard(0)])
    for y in both_modes(lambda: a + b):
        assert_dtensor_equal(a_np + b_np, (Shard(0), Replicate()), y, rtol=1e-6)


def test_partial_operands_are_reduced_first():
    coords = MESH.local_coordinates()
    p = DTensor.from_local([np.full((2, 4), c[1], np.float32) for c in coords], MESH, [Replicate(), Partial()])
    y = p * 2.0
    assert_dtensor_equal(np.full((2, 4), 12.0, np.float32), (Replicate(), Replicate()), y)


@pytest.mark.parametrize("api, ref", [
    (tf.reduce_sum, np.sum), (tf.reduce_mean, np.mean), (tf.reduce_max, np.max),
    (tf.reduce_min, np.min), (tf.reduce_prod, np.prod),
])
@pytest.mark.parametrize("shape", [(8, 12), (7, 5)], ids=["even", "uneven"])
def test_reductions(api, ref, shape):
    x_np = (rand(*shape) * 0.5 + 1).astype(np.float32)
    x = distribute_tensor(x_np, MESH, [Shard(0), Shard(1)])
    for r in both_modes(lambda: api(x, axis=1)):
        assert_dtensor_equal(ref(x_np, axis=1), (Shard(0), Replicate()), r, rtol=1e-4)
    r = api(x, axis=0, keepdims=True)
    assert_dtensor_equal(ref(x_np, axis=0, keepdims=True), (Replicate(), Shard(1)), r, rtol=1e-4)
    np.testing.assert_allclose(api(x).numpy(), ref(x_np), rtol=1e-4)


def test_reshape_transpose_softmax():
    x_np = rand(8, 6, 4)
    x = distribute_tensor(x_np, MESH, [Shard(0), Replicate()])
    assert_dtensor_equal(x_np.reshape(8, 24), (Shard(0), Replicate()), tf.reshape(x, (8, -1)))
    y = distribute_tensor(x_np, MESH, [Replicate(), Shard(1)])
    assert_dtensor_equal(x_np.reshape(48, 4), (Replicate(), Replicate()), tf.reshape(y, (48, 4)))
    assert_dtensor_equal(x_np.transpose(2, 0, 1), (Shard(1), Replicate()), tf.transpose(x, (2, 0, 1)))
    z = distribute_tensor(x_np, MESH, [Shard(0), Shard(2)])
    e = np.exp(x_np - x_np.max(-1, keepdims=True))
    assert_dtensor_equal(e / e.sum(-1, keepdims=True), (Shard(0), Replicate()), tf.nn.softmax(z), rtol=1e-5)


def test_gradients_are_dtensors_on_the_same_mesh():
    x_np, w_np = rand(8, 6), rand(6, 4)
    x = distribute_tensor(x_np, MESH, [Shard(0), Replicate()])
    w = distribute_tensor(w_np, MESH, [Replicate(), Shard(1)])
    with tf.GradientTape() as tape:
        tape.watch(w)
        loss = tf.reduce_sum(tf.nn.relu(x @ w) ** 2)
    g = tape.gradient(loss, w)
    h = x_np @ w_np
    want = x_np.T @ (2 * np.maximum(h, 0))
    assert_dtensor_equal(want, (Replicate(), Shard(1)), g, rtol=1e-4, atol=1e-4)


def test_bad_input():
    a = distribute_tensor(rand(4, 4), MESH, [Shard(0), Replicate()])
    other = distribute_tensor(rand(4, 4), MESH_42, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="must live on one mesh"):
        a + other
    with pytest.raises(TypeError, match="lives on no mesh"):
        a + np.ones((4, 4), np.float32)
    with pytest.raises(TypeError, match="mixing them is not allowed"):
        tf.matmul(a, tf.ones((4, 4)))
    with pytest.raises(ValueError, match="cannot reshape"):
        tf.reshape(a, (5, 3))
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        tf.reduce_sum(a, axis=2)
