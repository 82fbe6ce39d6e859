"""Gradients through DTensor.from_local / to_local / local_tensors, with torch's grad_placements.

References are derived by hand from the global value each call builds: from_local of one tensor x on a
(2, 4) mesh makes a global tensor whose every element is an element of x, used as many times as the
placements copy it; the loss is sum(global ** 2), so d loss / d x = 2 x * (number of uses)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

MESH = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b"))
X = np.arange(6.0).reshape(2, 3)


@pytest.mark.parametrize("placements, uses", [
    ([Shard(0), Shard(1)], 8),        # tiled 2 x 4 times: each element appears 8 times
    ([Replicate(), Shard(0)], 4),     # tiled 4 times along dim 0, one value along a
    ([Replicate(), Replicate()], 1),  # one value: the global tensor is x
    ([Partial(), Replicate()], 4),    # the sum of 2 copies: (2x)^2 -> d/dx = 8x = 2x * 4
], ids=["SS", "RS", "RR", "PR"])
def test_from_local_of_one_tensor_gives_the_exact_gradient(placements, uses):
    x = tf.constant(X)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(DTensor.from_local(x, MESH, placements) ** 2)
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), 2 * X * uses)


def test_from_local_of_per_device_tensors_gives_each_its_gradient():
    xs = [tf.constant(np.full((2, 3), float(i))) for i in range(8)]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        loss = tf.reduce_sum(DTensor.from_local(xs, MESH, [Shard(0), Shard(1)]) ** 2)
    for i, g in enumerate(tape.gradient(loss, xs)):
        np.testing.assert_allclose(g.numpy(), np.full((2, 3), 2.0 * i))


def test_from_local_grad_placements_must_keep_each_local_shape():
    x = tf.constant(X)
    with tf.GradientTape() as tape:
        tape.watch(x)
        d = DTensor.from_local(x, MESH, [Shard(0), Shard(1)], grad_placements=[Shard(0), Shard(1)])
        loss = tf.reduce_sum(d ** 2)
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), 2 * X * 8)  # the default's gradient
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(DTensor.from_local(x, MESH, [Shard(0), Shard(1)],
                                                grad_placements=[Replicate(), Replicate()]) ** 2)
    with pytest.raises(ValueError, match=r"grad_placements=\[Replicate\(\), Replicate\(\)\] give local device 0 "
                                         r"a gradient block of shape \[4, 12\].*\[2, 3\]"):
        tape.gradient(loss, x)


def _gradient(d: DTensor, loss_of) -> np.ndarray:
    with tf.GradientTape() as tape:
        tape.watch(d._physical)
        loss = loss_of(d)
    return DTensor._wrap(tape.gradient(loss, d._physical), d._spec).numpy()


def test_to_local_gradient_reaches_the_first_devices_shard_only():
    """Shard(0) over a, Replicate over b: device 0 holds rows 0-3; only they carry a gradient."""
    g0 = np.arange(32.0).reshape(8, 4)
    d = distribute_tensor(tf.constant(g0), MESH, [Shard(0), Replicate()])
    want = np.concatenate([2 * g0[:4], np.zeros((4, 4))])
    np.testing.assert_allclose(_gradient(d, lambda t: tf.reduce_sum(t.to_local() ** 2)), want)
    # torch's default reading (the local gradients of Replicate are copies of one value, trusted):
    # the first device's gradient is read as the value
    trusted = _gradient(d, lambda t: tf.reduce_sum(t.to_local(grad_placements=[Shard(0), Replicate()]) ** 2))
    np.testing.assert_allclose(trusted, want)


def test_local_tensors_gradient_counts_every_copy():
    """All 8 local shards used: rows 0-3 are read by the 4 devices along b, so are rows 4-7."""
    g0 = np.arange(32.0).reshape(8, 4)
    d = distribute_tensor(tf.constant(g0), MESH, [Shard(0), Replicate()])
    got = _gradient(d, lambda t: tf.add_n([tf.reduce_sum(s ** 2) for s in t.local_tensors()]))
    np.testing.assert_allclose(got, 4 * 2 * g0)


def test_to_local_of_a_partial_sums_the_local_gradients_of_every_device_it_reads():
    """Partial over a (2 copies of 0.5 g0 summed), Replicate over b: to_local reads device 0's part;
    its gradient goes to that part only, and the DTensor keeps its Partial gradient form."""
    g0 = np.arange(8.0).reshape(2, 4)
    d = DTensor.from_local([tf.constant(0.5 * g0)] * 8, MESH, [Partial(), Replicate()])
    with tf.GradientTape() as tape:
        tape.watch(d._physical)
        loss = tf.reduce_sum(d.to_local() * 3.0)
    grad = DTensor._wrap(tape.gradient(loss, d._physical), d._spec)
    parts = grad.local_tensors()
    np.testing.assert_allclose(parts[0].numpy(), np.full((2, 4), 3.0))   # device 0 (a = 0, b = 0)
    np.testing.assert_allclose(parts[4].numpy(), np.zeros((2, 4)))       # device 4 (a = 1, b = 0)


def test_full_tensor_grad_placements_is_replicate_or_refused():
    """The gradient of full_tensor()'s result is one global value: Replicate (torch's default) works and
    gives the gradient to each shard; per-rank readings (Partial, Shard) are refused naming the argument."""
    g0 = np.arange(16.0).reshape(4, 4)
    d = distribute_tensor(tf.constant(g0), MESH, [Shard(0), Replicate()])
    # the loss stays a DTensor: an eager tape seeds a raw TF DTensor loss with a host tensor (TF's bug,
    # worked around by tfdist.keras only)
    full = lambda t: DTensor.from_tf(t.full_tensor(grad_placements=[Replicate(), Replicate()]))  # noqa: E731
    got = _gradient(d, lambda t: tf.reduce_sum(full(t) ** 2))
    np.testing.assert_allclose(got, 2 * g0)
    for bad in ([Partial(), Replicate()], [Shard(1), Replicate()]):
        with pytest.raises(ValueError, match=r"full_tensor: grad_placements must be None or all Replicate\(\)"):
            d.full_tensor(grad_placements=bad)
