"""What tfdist does that plain TF DTensor refuses or gets wrong; each test shows both."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
from conftest import make_mesh
from reference import assert_dtensor_equal
from tfdist.tensor import Replicate, Shard, distribute_tensor, rand, randn

MESH = make_mesh((2, 4))


def test_uneven_shard_plain_tf_dtensor_refuses_tfdist_follows_torch_chunk():
    x = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
    layout = dtensor.Layout(["tp", dtensor.UNSHARDED], MESH.to_tf())
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError, tf.errors.UnknownError)):
        dtensor.relayout(dtensor.copy_to_mesh(x, dtensor.Layout.replicated(MESH.to_tf(), 2)), layout)
    d = distribute_tensor(x, MESH, [Replicate(), Shard(0)])
    assert [t.shape[0] for t in d.local_tensors()[:4]] == [2, 2, 2, 0]
    assert_dtensor_equal(x, (Replicate(), Shard(0)), d)


def _reset(seed=3):
    tf.random.set_seed(seed)


@pytest.mark.parametrize("factory", [rand, randn], ids=["rand", "randn"])
def test_same_seed_same_values_on_any_mesh(factory):
    one_device = tfdist.DeviceMesh("cpu", [5])
    layouts = [
        (one_device, [Replicate()]),
        (make_mesh((8, 1)), [Shard(0), Replicate()]),
        (MESH, [Shard(1), Shard(0)]),
        (MESH, [Replicate(), Replicate()]),
        (make_mesh((2, 2, 2)), [Shard(0), Replicate(), Shard(1)]),
    ]
    values = []
    for mesh, placements in layouts:
        _reset()
        values.append(factory(13, 7, device_mesh=mesh, placements=placements).numpy())
    for v in values[1:]:
        np.testing.assert_array_equal(v, values[0])  # bit for bit
    _reset(4)
    assert not np.array_equal(factory(13, 7, device_mesh=MESH).numpy(), values[0])


def test_plain_tf_dtensor_random_depends_on_layout():
    """TF DTensor's stateless random op gives a different tensor once sharded."""
    seed = [1, 2]
    mesh = MESH.to_tf()
    full = dtensor.call_with_layout(
        tf.random.stateless_normal, dtensor.Layout.replicated(mesh, 2), shape=(8, 8), seed=seed
    )

    @tf.function
    def sharded_normal(anchor):
        # the layout of a DTensor input drives the random op's layout
        z = tf.random.stateless_normal((8, 8), seed=seed)
        return dtensor.relayout(z + 0 * anchor, dtensor.Layout(["dp", "tp"], mesh))

    anchor = dtensor.call_with_layout(tf.zeros, dtensor.Layout(["dp", "tp"], mesh), shape=(8, 8))
    sharded = dtensor.relayout(sharded_normal(anchor), dtensor.Layout.replicated(mesh, 2))
    assert not np.array_equal(sharded.numpy(), full.numpy())


def test_random_values_have_the_right_distribution():
    _reset(11)
    u = rand(200, 100, device_mesh=MESH, placements=[Shard(0), Shard(1)]).numpy().ravel()
    _reset(12)
    z = randn(200, 100, device_mesh=MESH, placements=[Shard(1), Shard(0)]).numpy().ravel()
    assert u.min() >= 0 and u.max() < 1
    assert scipy.stats.kstest(u, "uniform").pvalue > 1e-3
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 0.03  # neighbours independent
