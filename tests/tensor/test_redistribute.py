"""Every redistribute transition, eager and in tf.function, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import MESH_SHAPES, make_mesh
from reference import all_placements, assert_dtensor_equal
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import explain_redistribute

MESHES = {s: make_mesh(s) for s in MESH_SHAPES}
X = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)   # even on every mesh
U = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)     # uneven on every mesh


def _run(d: DTensor, mesh, placements, graph: bool) -> DTensor:
    if not graph:
        return d.redistribute(mesh, placements)
    return tf.function(lambda t: t.redistribute(mesh, placements))(d)


ONE_D = [
    (Shard(0), Replicate(), "all_gather"),
    (Shard(0), Shard(1), "all_to_all"),
    (Shard(1), Shard(0), "all_to_all"),
    (Replicate(), Shard(0), "none"),
    (Replicate(), Shard(1), "none"),
    (Shard(1), Replicate(), "all_gather"),
]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("x", [X, U], ids=["even", "uneven"])
@pytest.mark.parametrize("src, dst, collective", ONE_D, ids=lambda v: str(v))
def test_one_d_transitions(src, dst, collective, x, graph):
    mesh = MESHES[(8,)]
    d = distribute_tensor(x, mesh, [src])
    steps = [s.collective for s in explain_redistribute(d, mesh, [dst])]
    assert steps == ([] if collective == "none" else [collective])  # a local slice is no step
    assert_dtensor_equal(x, (dst,), _run(d, mesh, [dst], graph))


def _partial_parts(mesh, x, op):
    """Per-device partial values whose reduction over 'tp' is x (replicas along dp agree)."""
    k = mesh.shape[1]
    coords = mesh.local_coordinates()
    if op == "sum":
        return [x * (c[1] + 1) / (k * (k + 1) / 2) for c in coords]
    if op == "avg":
        return [x + (c[1] - (k - 1) / 2) for c in coords]
    if op == "max":
        return [x - c[1] for c in coords]
    if op == "min":
        return [x + c[1] for c in coords]
    return [x if c[1] == 0 else np.ones_like(x) for c in coords]  # product


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
@pytest.mark.parametrize("dst, collective", [
    (Replicate(), "all_reduce"), (Shard(0), "reduce_scatter"), (Shard(1), "reduce_scatter"),
])
def test_partial_transitions(op, dst, collective, graph):
    mesh = MESHES[(2, 4)]
    x = U
    d = DTensor.from_local(_partial_parts(mesh, x, op), mesh, [Replicate(), Partial(op)])
    assert [s.collective for s in explain_redistribute(d, mesh, [Replicate(), dst])] == [collective]
    out = _run(d, mesh, [Replicate(), dst], graph)
    assert_dtensor_equal(x, (Replicate(), dst), out, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (2, 2, 2)], ids=str)
def test_all_n_d_pairs(mesh_shape, graph):
    """Every pair of Shard/Replicate placements on an N-D mesh, even and uneven."""
    mesh = MESHES[mesh_shape]
    combos = list(all_placements(2, len(mesh_shape)))
    rng = np.random.default_rng(len(mesh_shape))
    pairs = [(combos[i], combos[j]) for i, j in rng.integers(0, len(combos), (12, 2))]
    for x in (X, U):
        for src, dst in pairs:
            d = distribute_tensor(x, mesh, src)
            assert_dtensor_equal(x, tuple(dst), _run(d, mesh, dst, graph))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(MESH_SHAPES),
    st.lists(st.integers(1, 10), min_size=1, max_size=3),
    st.data(),
)
def test_random_round_trips(mesh_shape, shape, data):
    mesh = MESHES[mesh_shape]
    combos = list(all_placements(len(shape), len(mesh_shape)))
    src = data.draw(st.sampled_from(combos))
    dst = data.draw(st.sampled_from(combos))
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    out = distribute_tensor(x, mesh, src).redistribute(mesh, dst)
    assert_dtensor_equal(x, tuple(dst), out)


def test_mixed_partial_and_shard_on_2d():
    mesh = MESHES[(2, 4)]
    x = X
    parts = _partial_parts(mesh, x, "sum")
    coords = mesh.local_coordinates()
    # shard rows over dp and keep the Partial over tp
    local = [p[4 * c[0]: 4 * (c[0] + 1)] for p, c in zip(parts, coords)]
    d = DTensor.from_local(local, mesh, [Shard(0), Partial()])
    steps = {s.mesh_dim: s.collective for s in explain_redistribute(d, mesh, [Shard(1), Shard(0)])}
    assert steps == {"dp": "all_to_all", "tp": "reduce_scatter"}
    assert_dtensor_equal(x, (Shard(1), Shard(0)), d.redistribute(mesh, [Shard(1), Shard(0)]), atol=1e-4)


def test_gradient_flows_through_redistribute_eager():
    mesh = MESHES[(2, 4)]
    d = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    with tf.GradientTape() as tape:
        tape.watch(d)
        r = d.redistribute(mesh, [Replicate(), Shard(0)])
        loss = tf.reduce_sum(r ** 2)
    g = tape.gradient(loss, d)
    assert isinstance(g, DTensor) and g.placements == (Shard(0), Shard(1))
    np.testing.assert_allclose(g.numpy(), 2 * X)


def test_full_tensor_is_differentiable_in_tf_function():
    mesh = MESHES[(2, 4)]
    d = distribute_tensor(U, mesh, [Shard(1), Shard(0)])

    @tf.function
    def grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            full = t.full_tensor()
            loss = tf.reduce_sum(full * full)
        return tape.gradient(loss, t)

    g = grad(d)
    assert_dtensor_equal(2 * U, (Shard(1), Shard(0)), g)


def test_redistribute_to_partial_is_refused():
    mesh = MESHES[(8,)]
    d = distribute_tensor(X, mesh, [Replicate()])
    with pytest.raises(ValueError, match="redistributing to Partial"):
        d.redistribute(mesh, [Partial()])
    with pytest.raises(ValueError, match="needs placements"):
        d.redistribute(mesh)
    with pytest.raises(ValueError, match="within one root mesh"):
        d.redistribute(make_mesh((2, 4)), [Replicate(), Replicate()])


def test_redistribute_logging(monkeypatch, caplog):
    import logging

    from tfdist.tensor import _redistribute

    mesh = MESHES[(2, 4)]
    d = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    _redistribute.logger.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG, logger="tfdist.redistribute"):
            d.redistribute(mesh, [Replicate(), Shard(0)])
    finally:
        _redistribute.logger.setLevel(logging.NOTSET)
    assert "dp: S(0) -> R (all_gather); tp: S(1) -> S(0) (all_to_all)" in caplog.text


@pytest.mark.parametrize("source", [("tp", "dp"), ("dp", "tp"), ("tp", None), (None, "dp")])
@pytest.mark.parametrize("target", [(None, None), ("tp", None), (None, "tp")])
def test_relayout_traced_gathers_one_mesh_dim_at_a_time(source, target):
    """Inside tf.function the source layout is TF DTensor's to decide; TF's own relayout of
    (tp, dp) on a (dp, tp) mesh to replicated returns wrong values under the gather lowering
    (docs/tf_dtensor_repros/all_gather_two_mesh_dims.py).  relayout_traced stages it."""
    from tensorflow.experimental import dtensor

    from tfdist.tensor._redistribute import relayout, relayout_traced

    mesh = MESHES[(2, 4)].to_tf()
    U = dtensor.UNSHARDED
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    specs = lambda names: [n or U for n in names]  # noqa: E731
    x = relayout(dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(mesh, 2)),
                 dtensor.Layout(specs(source), mesh))
    target_layout = dtensor.Layout(specs(target), mesh)
    y = tf.function(lambda t: relayout_traced(t * 1.0, target_layout))(x)
    assert dtensor.fetch_layout(y) == target_layout
    full = relayout(y, dtensor.Layout.replicated(mesh, 2))
    np.testing.assert_array_equal(dtensor.unpack(full)[0].numpy(), value)
