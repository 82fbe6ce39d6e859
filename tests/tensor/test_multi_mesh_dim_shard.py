"""One tensor dim sharded over several mesh dims ((Shard(0), Shard(0)) and the 3-D forms).

torch's meaning: the dim is chunked over the first mesh dim, each chunk over
the next (torch.chunk at each level).  The reference is numpy slicing by
hand (tests/reference.py: expected_shard nests the chunks).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfdist
from conftest import make_mesh
from reference import assert_dtensor_equal, coords, expected_shard
from tfdist.tensor import (
    DTensor, Partial, Replicate, Shard, compute_local_shape_and_global_offset, distribute_tensor, randn, zeros,
)
from tfdist.tensor.debug import CommDebugMode, explain_redistribute, visualize_sharding

MESHES = {s: make_mesh(s) for s in [(2, 4), (4, 2), (2, 2, 2)]}


def nested_placements(draw, mesh_ndim: int, rank: int) -> tuple:
    """Placements with one tensor dim on two or more mesh dims (the others: R or another dim)."""
    d = draw(st.integers(0, rank - 1))
    nested = draw(st.lists(st.integers(0, mesh_ndim - 1), min_size=2, max_size=mesh_ndim, unique=True))
    others = [Replicate()] + [Shard(i) for i in range(rank) if i != d]
    return tuple(Shard(d) if m in nested else draw(st.sampled_from(others)) for m in range(mesh_ndim))


@st.composite
def cases(draw):
    mesh_shape = draw(st.sampled_from(list(MESHES)))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 11)) for _ in range(rank))  # empty tensors: the reliability work
    return MESHES[mesh_shape], shape, nested_placements(draw, len(mesh_shape), rank)


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(cases())
def test_local_shards_and_offsets_match_nested_chunks(case):
    mesh, shape, placements = case
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    d = distribute_tensor(x, mesh, placements)
    assert_dtensor_equal(x, placements, d)  # value, every local shard vs numpy
    assert np.array_equal(d.to_local().numpy(), expected_shard(x, mesh.shape, placements, coords(mesh.shape)[0]))
    for coord in coords(mesh.shape):
        local, offset = compute_local_shape_and_global_offset(shape, mesh, placements, coord)
        want = expected_shard(x, mesh.shape, placements, coord)
        assert local == want.shape
        if want.size:
            assert np.array_equal(x[tuple(slice(o, o + n) for o, n in zip(offset, local))], want)
    back = DTensor.from_local(d.local_tensors(), mesh, placements, shape=shape)
    assert_dtensor_equal(x, placements, back)


@settings(max_examples=40, deadline=None)
@given(cases(), st.data())
def test_redistribute_to_and_from_every_placement(case, data):
    mesh, shape, src = case
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    dst = tuple(data.draw(st.sampled_from(options)) for _ in range(mesh.ndim))
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    d = distribute_tensor(x, mesh, src)
    assert_dtensor_equal(x, dst, d.redistribute(mesh, dst))
    back = distribute_tensor(x, mesh, dst).redistribute(mesh, src)
    assert_dtensor_equal(x, src, back)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("shape", [(16, 3), (13, 3)], ids=["even", "uneven"])
def test_fsdp_over_tp_moves(shape, graph):
    """Gathering the inner mesh dim only (S0,S0)->(S0,R) is one all-gather over tp."""
    mesh = MESHES[(2, 4)]
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    d = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    move = (lambda t, p: t.redistribute(mesh, p)) if not graph else tf.function(lambda t, p: t.redistribute(mesh, p))
    for dst, kernels in [
        ([Shard(0), Replicate()], {"all_gather_into_tensor": 1}),
        ([Replicate(), Replicate()], {"all_gather_into_tensor": 2}),
        ([Replicate(), Shard(0)], {"all_gather_into_tensor": 2}),
    ]:
        if graph:
            fn = tf.function(lambda t, dst=dst: t.redistribute(mesh, dst))
            fn(d)
        else:
            fn = lambda t, dst=dst: t.redistribute(mesh, dst)  # noqa: E731
        with CommDebugMode() as comm:
            out = fn(d)
        assert_dtensor_equal(x, tuple(dst), out)
        assert comm.get_comm_counts() == kernels
    # into a nested shard from an outer shard, or from replicated: local
    for src in ([Shard(0), Replicate()], [Replicate(), Replicate()]):
        e = distribute_tensor(x, mesh, src)
        with CommDebugMode() as comm:
            out = move(e, [Shard(0), Shard(0)])
        assert_dtensor_equal(x, (Shard(0), Shard(0)), out)
        assert comm.get_comm_counts() == {}
        assert explain_redistribute(e, mesh, [Shard(0), Shard(0)]) == []


def test_three_d_nesting_and_partial():
    mesh = MESHES[(2, 2, 2)]
    x = np.arange(11 * 4, dtype=np.float32).reshape(11, 4)
    for placements in [(Shard(0),) * 3, (Shard(0), Replicate(), Shard(0)), (Shard(1), Shard(0), Shard(0))]:
        d = distribute_tensor(x, mesh, placements)
        assert_dtensor_equal(x, placements, d)
        assert_dtensor_equal(x, (Replicate(),) * 3, d.redistribute(mesh, [Replicate()] * 3))
    parts = [np.full((8, 4), 1.0, np.float32) for _ in range(8)]
    p = DTensor.from_local([tf.constant(t[:4]) for t in parts], mesh, [Partial(), Shard(0), Replicate()], shape=(8, 4))
    out = p.redistribute(mesh, [Shard(0), Shard(0), Replicate()])
    assert_dtensor_equal(np.full((8, 4), 2.0, np.float32), (Shard(0), Shard(0), Replicate()), out)


def test_ops_factories_and_tools():
    mesh = MESHES[(2, 4)]
    x = np.random.default_rng(3).standard_normal((9, 4)).astype(np.float32)
    d = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    np.testing.assert_allclose((d * 2.0 + 1.0).full_tensor().numpy(), x * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(tf.reduce_sum(d, 0).full_tensor().numpy(), x.sum(0), rtol=1e-5)
    w = distribute_tensor(np.ones((4, 2), np.float32), mesh, [Replicate(), Replicate()])
    np.testing.assert_allclose(tf.matmul(d, w).full_tensor().numpy(), x @ np.ones((4, 2)), rtol=1e-5)
    tfdist.manual_seed(5)
    a = randn(9, 4, device_mesh=mesh, placements=[Shard(0), Shard(0)])
    tfdist.manual_seed(5)
    b = randn(9, 4, device_mesh=mesh, placements=[Replicate(), Replicate()])
    np.testing.assert_array_equal(a.full_tensor().numpy(), b.full_tensor().numpy())
    assert zeros(9, 4, device_mesh=mesh, placements=[Shard(0), Shard(0)]).full_tensor().numpy().sum() == 0
    table = visualize_sharding(d)
    assert "(S(0), S(0))" in table and "4:5" in table  # device (1, 0) holds row 4 (5 + 4 rows)


def test_local_map_of_nested_and_uneven_shards_runs_per_device_eagerly():
    """One dim over two mesh dims, and 10 rows over 8 devices (uneven, empty shards): the function runs
    on each device's own shard (a row-wise softmax and a row count), results put back as torch's
    shards; inside a tf.function this form is refused with the reason."""
    from tfdist.tensor.experimental import local_map

    mesh = MESHES[(2, 4)]
    x = np.random.default_rng(1).standard_normal((10, 3)).astype(np.float32)
    softmax = np.exp(x) / np.exp(x).sum(1, keepdims=True)
    for placements in ([Shard(0), Shard(0)], [Shard(0), Replicate()], [Replicate(), Shard(0)]):
        d = distribute_tensor(x, mesh, placements)
        fn = local_map(lambda t: (tf.nn.softmax(t), tf.shape(t, out_type=tf.int64)[:1]),
                       out_placements=[placements, [Shard(0), Shard(0)]],
                       device_mesh=mesh)
        y, rows = fn(d)
        assert y.placements == tuple(placements)
        np.testing.assert_allclose(y.full_tensor().numpy(), softmax, rtol=1e-6)
        # each device's row count, as torch.chunk gives it
        sizes = [t.shape[0] for t in d.local_tensors()]
        np.testing.assert_array_equal(rows.full_tensor().numpy(), sizes)
    d = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    fn = local_map(lambda t: t * 2, out_placements=[Shard(0), Shard(0)], device_mesh=mesh)
    with pytest.raises(ValueError, match="runs per device, eagerly"):
        tf.function(fn)(d)


def test_nested_shards_move_eagerly_without_tfdist_keras(tmp_path):
    """The local gather of a nested redistribute reads its row index as a DTensor when eager
    (before: it relied on tfdist.keras' host-tensor rows, and failed in a process without them)."""
    import subprocess
    import sys

    script = tmp_path / "nested.py"
    script.write_text(
        "import sys, numpy as np\n"
        "import tfdist\n"
        "tfdist.virtual_cpus(8)\n"
        "from tfdist.tensor import distribute_tensor, Shard, Replicate\n"
        "mesh = tfdist.init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp'))\n"
        "x = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)\n"
        "d = distribute_tensor(x, mesh, [Shard(0), Shard(0)])\n"
        "e = d.redistribute(mesh, [Shard(1), Replicate()]).redistribute(mesh, [Shard(0), Shard(0)])\n"
        "assert np.array_equal(e.full_tensor().numpy(), x)\n"
        "assert 'tfdist.keras' not in sys.modules, 'the test needs a process without tfdist.keras'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
