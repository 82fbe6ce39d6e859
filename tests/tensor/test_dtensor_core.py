"""DTensor construction and local views, checked against numpy slicing."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorflow.experimental import dtensor

from conftest import MESH_SHAPES, make_mesh
from reference import assert_dtensor_equal, chunk_bounds, expected_shard
from tfdist.tensor import (
    DTensor, Partial, Replicate, Shard, compute_local_shape_and_global_offset,
    distribute_tensor, empty, full, ones, rand, randn, zeros,
)

HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MESHES = {s: make_mesh(s) for s in MESH_SHAPES}


@st.composite
def tensor_and_placements(draw):
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    placements = []
    free = list(range(ndim))
    for _ in mesh_shape:
        options = [Replicate()] + [Shard(d) for d in free]
        p = draw(st.sampled_from(options))
        if isinstance(p, Shard):
            free.remove(p.dim)
        placements.append(p)
    return mesh_shape, shape, tuple(placements)


@HYP
@given(tensor_and_placements())
def test_distribute_round_trip_and_local_shards(case):
    mesh_shape, shape, placements = case
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    d = distribute_tensor(x, MESHES[mesh_shape], placements)
    assert_dtensor_equal(x, placements, d)


def test_uneven_shard_follows_torch_chunk():
    sub = make_mesh((4, 2))["dp"]  # 4 devices
    for n, sizes in ((6, [2, 2, 2, 0]), (5, [2, 2, 1, 0])):
        d = distribute_tensor(np.arange(float(n)), sub, [Shard(0)])
        got = [d.local_tensors()[i].shape[0] for i in (0, 2, 4, 6)]  # dp = 0..3
        assert got == sizes
    assert [compute_local_shape_and_global_offset((6,), sub, [Shard(0)], [i]) for i in range(4)] == [
        ((2,), (0,)), ((2,), (2,)), ((2,), (4,)), ((0,), (6,)),
    ]


def test_compute_local_shape_default_coordinate(mesh_2d):
    assert compute_local_shape_and_global_offset((6, 9), mesh_2d, [Shard(0), Shard(1)]) == ((3, 3), (0, 0))
    assert compute_local_shape_and_global_offset((6, 9), mesh_2d, [Shard(0), Shard(1)], [1, 3]) == ((3, 0), (3, 9))


def test_from_local_single_tensor_every_device(mesh_2d):
    local = tf.reshape(tf.range(6.0), (2, 3))
    d = DTensor.from_local(local, mesh_2d, [Shard(0), Replicate()])
    assert tuple(d.shape) == (4, 3)
    np.testing.assert_array_equal(d.numpy(), np.tile(local.numpy(), (2, 1)))
    np.testing.assert_array_equal(d.to_local().numpy(), local.numpy())


def test_from_local_list_and_local_tensors(mesh_2d):
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    placements = (Shard(1), Shard(0))
    coords = mesh_2d.local_coordinates()
    parts = [expected_shard(x, (2, 4), placements, c) for c in coords]
    d = DTensor.from_local(parts, mesh_2d, placements, run_check=True)
    assert_dtensor_equal(x, placements, d)
    for got, want in zip(d.local_tensors(), parts):
        np.testing.assert_array_equal(got.numpy(), want)


def test_from_local_uneven_needs_shape(mesh_2d):
    x = np.arange(10.0, dtype=np.float32)
    coords = mesh_2d.local_coordinates()
    parts = [x[slice(*chunk_bounds(10, 4, c[1]))] for c in coords]
    d = DTensor.from_local(parts, mesh_2d, [Replicate(), Shard(0)], shape=(10,))
    assert_dtensor_equal(x, (Replicate(), Shard(0)), d)
    with pytest.raises(ValueError, match="Pass shape= for uneven shards"):
        DTensor.from_local(parts, mesh_2d, [Replicate(), Shard(0)])


@pytest.mark.parametrize("op, reduce", [
    ("sum", np.sum), ("avg", np.mean), ("product", np.prod), ("max", np.max), ("min", np.min),
])
def test_from_local_partial_reduces_like_the_op(mesh_2d, op, reduce):
    coords = mesh_2d.local_coordinates()
    # the value of device (dp, tp) depends on tp only: replicas along dp agree
    parts = [np.full((2, 3), c[1] + 1.0, np.float32) for c in coords]
    d = DTensor.from_local(parts, mesh_2d, [Replicate(), Partial(op)], run_check=True)
    want = np.full((2, 3), reduce(np.arange(1.0, 5.0)), np.float32)
    np.testing.assert_allclose(d.numpy(), want)
    np.testing.assert_array_equal(d.to_local().numpy(), parts[0])


def test_run_check_catches_disagreeing_replicas(mesh_2d):
    parts = [np.full((2,), float(i), np.float32) for i in range(8)]
    with pytest.raises(ValueError, match="should be replicas"):
        DTensor.from_local(parts, mesh_2d, [Replicate(), Shard(0)], run_check=True)


def test_chunk_list(mesh_2d):
    d = distribute_tensor(np.zeros((6, 8), np.float32), mesh_2d, [Shard(1), Shard(0)])
    chunks = d.__create_chunk_list__()
    assert len(chunks) == 8
    assert chunks[0].sizes == (2, 4) and chunks[0].offsets == (0, 0)
    assert chunks[3].sizes == (0, 4) and chunks[3].offsets == (6, 0)  # tp=3 gets nothing
    assert chunks[5].sizes == (2, 4) and chunks[5].offsets == (2, 4)


def test_tf_interop(mesh_2d):
    tf_mesh = mesh_2d.to_tf()
    layout = dtensor.Layout(["tp", dtensor.UNSHARDED], tf_mesh)
    raw = dtensor.call_with_layout(tf.ones, layout, shape=(8, 2))
    d = DTensor.from_tf(raw)
    assert d.placements == (Replicate(), Shard(0))
    assert d.to_tf() is raw
    assert dtensor.fetch_layout(d.to_tf()).sharding_specs == ["tp", "unsharded"]
    # raw TF DTensor code keeps working on what tfdist produced
    doubled = DTensor.from_tf(d.to_tf() * 2)
    np.testing.assert_array_equal(doubled.numpy(), np.full((8, 2), 2.0))
    # uneven and Partial become a TF layout that holds the same values
    u = distribute_tensor(np.arange(6.0), mesh_2d, [Replicate(), Shard(0)])
    np.testing.assert_array_equal(u.to_tf().numpy(), np.arange(6.0))


def test_distribute_a_raw_tf_dtensor(mesh_2d):
    layout = dtensor.Layout(["dp", dtensor.UNSHARDED], mesh_2d.to_tf())
    raw = dtensor.call_with_layout(tf.ones, layout, shape=(4, 8))
    d = distribute_tensor(raw, mesh_2d, [Replicate(), Shard(1)])
    assert_dtensor_equal(np.ones((4, 8), np.float32), (Replicate(), Shard(1)), d)


@pytest.mark.parametrize("factory, value", [(zeros, 0.0), (ones, 1.0), (empty, 0.0)])
def test_constant_factories(mesh_2d, factory, value):
    d = factory(6, 8, device_mesh=mesh_2d, placements=[Shard(0), Shard(1)])
    assert_dtensor_equal(np.full((6, 8), value, np.float32), (Shard(0), Shard(1)), d)
    d64 = factory((3, 4), dtype=tf.float64, device_mesh=mesh_2d, placements=[Replicate(), Shard(1)])
    assert d64.dtype == tf.float64 and tuple(d64.shape) == (3, 4)


def test_full(mesh_2d):
    d = full((5, 4), 3.5, device_mesh=mesh_2d, placements=[Replicate(), Shard(0)])
    assert_dtensor_equal(np.full((5, 4), 3.5, np.float32), (Replicate(), Shard(0)), d)


@pytest.mark.parametrize("factory", [rand, randn])
def test_random_factories_same_values_on_any_mesh(factory):
    tf.random.set_seed(7)
    a = factory(6, 8, device_mesh=MESHES[(8,)], placements=[Shard(0)]).numpy()
    tf.random.set_seed(7)
    b = factory(6, 8, device_mesh=MESHES[(2, 4)], placements=[Shard(1), Shard(0)]).numpy()
    np.testing.assert_array_equal(a, b)
    assert a.std() > 0.1
    if factory is rand:
        assert a.min() >= 0.0 and a.max() < 1.0


@pytest.mark.parametrize("factory", ["zeros", "ones", "empty", "full", "rand", "randn"])
def test_factories_take_torchs_layout_argument(mesh_2d, factory):
    """torch's factories take ``layout=torch.strided`` (the default); TF DTensor shards dense tensors only,
    so a sparse layout is refused naming the argument."""
    make = {"zeros": zeros, "ones": ones, "empty": empty, "rand": rand, "randn": randn,
            "full": lambda *s, **kw: full(s, 2.0, **kw)}[factory]
    for layout in (None, "strided", "torch.strided"):
        d = make(4, 2, layout=layout, device_mesh=mesh_2d, placements=[Shard(0), Replicate()])
        assert tuple(d.shape) == (4, 2) and d.placements == (Shard(0), Replicate())
    with pytest.raises(ValueError, match=rf"{factory}: layout must be None or 'strided'.*layout='sparse_coo'"):
        make(4, 2, layout="sparse_coo", device_mesh=mesh_2d)


def test_with_mesh_is_the_default(mesh_2d):
    with mesh_2d:
        d = distribute_tensor(np.ones((2, 4), np.float32), placements=[Replicate(), Shard(1)])
        z = zeros(4, 4)
    assert d.device_mesh == mesh_2d and z.placements == (Replicate(), Replicate())
    with pytest.raises(ValueError, match="needs a device_mesh"):
        distribute_tensor(np.ones(2))


def test_bad_input(mesh_2d):
    x = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"placements has 1 entries but the mesh has 2 dims"):
        distribute_tensor(x, mesh_2d, [Shard(0)])
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) is out of range"):
        distribute_tensor(x, mesh_2d, [Shard(2), Replicate()])
    with pytest.raises(ValueError, match="cannot create Partial"):
        distribute_tensor(x, mesh_2d, [Partial(), Replicate()])
    with pytest.raises(TypeError, match="tensor must be a tf.Tensor"):
        distribute_tensor(object(), mesh_2d)
    with pytest.raises(TypeError, match="device_mesh must be a tfdist DeviceMesh"):
        distribute_tensor(x, mesh_2d.to_tf())
    # one dim over two mesh dims is torch's nesting now (tests/tensor/test_multi_mesh_dim_shard.py)
    np.testing.assert_array_equal(distribute_tensor(x, mesh_2d, [Shard(0), Shard(0)]).numpy(), x)
    d = distribute_tensor(x, mesh_2d)
    with pytest.raises(ValueError, match="not a DTensor"):
        distribute_tensor(d, mesh_2d)
    with pytest.raises(ValueError, match="list of 3 tensors but this client owns 8"):
        DTensor.from_local([x, x, x], mesh_2d)
    with pytest.raises(ValueError, match="stride must be None or"):
        DTensor.from_local(x, mesh_2d, stride=(1, 4))
    with pytest.raises(ValueError, match="src_data_rank must be None or a client rank"):
        distribute_tensor(x, mesh_2d, src_data_rank=3)


def test_local_views_are_eager_only(mesh_2d):
    d = distribute_tensor(np.ones((8, 8), np.float32), mesh_2d, [Shard(0), Replicate()])

    @tf.function
    def f(t):
        return t.to_local()

    with pytest.raises(RuntimeError, match="needs eager mode"):
        f(d)


def test_seeding_like_torch():
    """manual_seed, tf.random.set_seed and keras.utils.set_random_seed all restart the sequence."""
    import keras

    import tfdist

    mesh1 = tfdist.DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("x",))
    tf.random.set_seed(1234)
    a1, a2 = (randn(4, 2, device_mesh=mesh1).numpy() for _ in range(2))
    assert not np.array_equal(a1, a2)  # successive calls differ
    tfdist.manual_seed(1234)
    b1 = randn(4, 2, device_mesh=MESHES[(2, 4)], placements=[Shard(0), Shard(1)]).numpy()
    b2 = randn(4, 2, device_mesh=MESHES[(8,)], placements=[Shard(1)]).numpy()
    keras.utils.set_random_seed(1234)
    c1 = randn(4, 2, device_mesh=MESHES[(2, 2, 2)], placements=[Replicate(), Shard(0), Shard(1)]).numpy()
    for got in (b1, c1):
        np.testing.assert_array_equal(got, a1)
    np.testing.assert_array_equal(b2, a2)
    with pytest.raises(TypeError, match="seed must be an int"):
        tfdist.manual_seed("1234")


def test_repr_has_no_stray_comma(mesh_2d):
    d = distribute_tensor(np.ones((4, 4), np.float32), mesh_2d, [Shard(0), Shard(1)])
    assert repr(d).endswith("placements=(Shard(dim=0), Shard(dim=1)))")
    one = distribute_tensor(np.ones(4, np.float32), MESHES[(8,)], [Shard(0)])
    assert repr(one).endswith("placements=(Shard(dim=0),))")  # a 1-tuple, as Python writes it


def test_string_dtensor_moves_that_need_a_collective_are_a_clear_type_error():
    from tfdist.tensor import Replicate, Shard, distribute_tensor

    mesh = make_mesh((8,))
    words = distribute_tensor(tf.constant([f"w{i}" for i in range(8)]), mesh, [Shard(0)])  # a local slice
    assert words.local_tensors()[3].numpy().tolist() == [b"w3"]
    with pytest.raises(TypeError, match="dtype string cannot be moved .* collectives carry numbers only"):
        words.full_tensor()
    with pytest.raises(TypeError, match="dtype string"):
        words.redistribute(mesh, [Replicate()])
    numbers = distribute_tensor(np.arange(8.0), mesh, [Shard(0)])  # the process is still fine
    np.testing.assert_array_equal(numbers.full_tensor().numpy(), np.arange(8.0))
