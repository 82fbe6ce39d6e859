"""Layouts TF DTensor's expanders refuse or compute wrongly, legalized (tfdist/tensor/_legalize.py).

Each program is raw TF DTensor: first shown to fail (or to compute wrongly) as TF expands it,
then run through ``Legalizer`` and compared with numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor import _legalize

U = dtensor.UNSHARDED
RNG = np.random.default_rng(0)


@pytest.fixture
def tf_mesh(mesh_2d):
    return mesh_2d.to_tf()


def _put(mesh, a: np.ndarray, *specs: str) -> tf.Tensor:
    replicated = dtensor.copy_to_mesh(tf.constant(a), dtensor.Layout.replicated(mesh, a.ndim))
    return dtensor.relayout(replicated, dtensor.Layout(list(specs), mesh))


def _numpy(mesh, y: tf.Tensor) -> np.ndarray:
    """``y``'s global value: one mesh dim gathered per relayout (TF's gather of two at once is
    wrong, docs/tf_dtensor_repros/all_gather_two_mesh_dims.py)."""
    specs = dtensor.fetch_layout(y).sharding_specs
    for i in range(len(specs)):
        specs = specs[:i] + [U] + specs[i + 1:]
        y = dtensor.relayout(y, dtensor.Layout(specs, mesh))
    return dtensor.unpack(y)[0].numpy()


def _as_tf_expands(fn, *args):
    """``fn`` traced and run by TF alone (``import tfdist.keras`` legalizes every tf.function)."""
    return _legalize._call_unpatched(tf.function(fn), *args)


def test_a_gather_whose_output_is_sharded_unlike_its_params_is_pinned_to_what_params_give(tf_mesh):
    params = RNG.standard_normal((16, 8)).astype(np.float32)
    ids = RNG.integers(0, 16, (8, 4)).astype(np.int32)
    layout = dtensor.Layout(["dp", U, "tp"], tf_mesh)

    def lookup(p, i):  # the consumer asks for the embedding dim over tp; params keep it whole
        return dtensor.relayout(tf.gather(p, i) * 2.0, layout)

    args = _put(tf_mesh, params, "tp", U), _put(tf_mesh, ids, "dp", U)
    with pytest.raises(tf.errors.OpError, match="do not agree on non-axis dim"):
        _as_tf_expands(lookup, *args)
    legalizer = _legalize.Legalizer(tf.function(lookup))
    np.testing.assert_array_equal(_numpy(tf_mesh, legalizer(*args)), np.take(params, ids, axis=0) * 2.0)
    [(pin, _, _)] = legalizer.plan.pins.values()
    assert pin.inputs == {} and "sharding_specs:dp,unsharded,unsharded," in pin.outputs[0]  # no table gathered


def test_a_split_along_a_sharded_dim_runs_on_that_dim_replicated(tf_mesh):
    x = RNG.standard_normal((8, 16)).astype(np.float32)

    def second_half(x):
        return tf.split(x, 2, axis=1)[1] + 1.0

    arg = _put(tf_mesh, x, U, "tp")
    with pytest.raises(tf.errors.OpError, match="Spliting over sharded dimension"):
        _as_tf_expands(second_half, arg)
    out = _legalize.Legalizer(tf.function(second_half))(arg)
    np.testing.assert_array_equal(_numpy(tf_mesh, out), np.split(x, 2, axis=1)[1] + 1.0)


def test_an_einsum_whose_operands_shard_different_contracting_dims_is_right(tf_mesh):
    """TF's own expansion is wrong here (docs/tf_dtensor_repros/einsum_two_contracting_dims.py)."""
    x = RNG.standard_normal((16, 8, 4, 8)).astype(np.float32)
    w = RNG.standard_normal((4, 8, 32)).astype(np.float32)
    expected = np.einsum("abcd,cde->abe", x, w)

    def project(a, b):
        return tf.einsum("abcd,cde->abe", a, b)

    args = _put(tf_mesh, x, "dp", U, U, "tp"), _put(tf_mesh, w, "tp", U, U)
    assert not np.allclose(_numpy(tf_mesh, _as_tf_expands(project, *args)), expected, atol=1e-3)
    np.testing.assert_allclose(_numpy(tf_mesh, _legalize.Legalizer(tf.function(project))(*args)), expected,
                               rtol=1e-5, atol=1e-4)


def test_a_program_tf_expands_is_traced_once_and_pinned_nowhere(tf_mesh):
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    traces = []

    def double(x):
        traces.append(1)
        return tf.reduce_sum(x * 2.0, axis=1)

    legalizer = _legalize.Legalizer(tf.function(double))
    np.testing.assert_allclose(_numpy(tf_mesh, legalizer(_put(tf_mesh, x, "dp", "tp"))), (x * 2).sum(1),
                               rtol=1e-5, atol=1e-5)  # a sum over 4 shards adds in another order
    assert legalizer.plan.pins == {} and len(traces) == 1


def test_an_error_that_names_no_refused_op_is_raised_as_tf_raised_it(tf_mesh):
    def bad(x):
        return tf.reshape(x, [3, -1])  # 128 elements: no such shape

    with pytest.raises((tf.errors.OpError, ValueError)) as raised:
        _legalize.Legalizer(tf.function(bad))(_put(tf_mesh, np.zeros((8, 16), np.float32), "dp", U))
    assert not isinstance(raised.value, _legalize.LayoutLegalizationError)


def test_parse_failure_reads_the_op_its_name_and_the_layouts():
    mesh = "|dp=2,tp=4|0,1,2,3,4,5,6,7|0,1,2,3,4,5,6,7|/job:localhost/replica:0/task:0/device:CPU:0"
    message = (
        "x.py:3:1: error: input and output layout do not agree on non-axis dim 1. \n"
        f"  params: sharding_specs:tp,unsharded, mesh:{mesh}\n"
        f"  output: sharding_specs:dp,unsharded,tp, mesh:{mesh}, axis: 0\n"
        'x.py:3:1: note: see current operation: %384 = "tf.GatherV2"(%382, %190, %64) <{batch_dims = 0 : i64}> '
        '{_global_shape = [#tf_type.shape<16x8x32>], _legalize_op = "model/token_embedding/GatherV2", device = ""} '
        ": (tensor<16x32xf32>, tensor<8x8xi32>, tensor<i32>) -> tensor<16x8x32xf32>\n"
        "tensorflow/dtensor/mlir/spmd_expander.cc:206 :: \n")
    failure = _legalize.parse_failure(RuntimeError(message))
    assert (failure.op_type, failure.op_name) == ("GatherV2", "model/token_embedding/GatherV2")
    assert (failure.input_ranks, failure.output_ranks, failure.mesh) == ((2, 0, 0), (3,), mesh)  # ids: never pinned
    pin = _legalize.pin_for(failure, message)
    assert pin.outputs == {0: f"sharding_specs:dp,unsharded,unsharded, mesh:{mesh}"} and pin.inputs == {}
    assert _legalize.parse_failure(RuntimeError("some other error")) is None


def test_empty_batch_sharded_tensors_gather_relayout_and_run_in_programs(tf_mesh):
    """A zero-size shard (keras-hub Gemma 3's ``generate`` without images) once killed the process:
    TF's CollectiveGatherV2 of an empty tensor.  Host reads, tfdist's relayouts and programs
    holding empty tensors (expanded with TF's all-reduce gather lowering) now work."""
    from tfdist import _runtime
    from tfdist.keras._data import gather_to_numpy
    from tfdist.tensor._redistribute import relayout

    empty = dtensor.call_with_layout(tf.zeros, dtensor.Layout(["dp", U], tf_mesh), shape=(0, 8))
    assert gather_to_numpy(empty).shape == (0, 8)
    moved = relayout(empty, dtensor.Layout([U, "tp"], tf_mesh))
    assert dtensor.fetch_layout(moved).sharding_specs == [U, "tp"] and moved.shape == (0, 8)

    def doubled_whole(x):
        return dtensor.relayout(x * 2.0, dtensor.Layout.replicated(tf_mesh, 2))

    lowering = _runtime.gather_lowering_is_collective()
    out = _legalize.Legalizer(tf.function(doubled_whole))(empty)
    assert out.shape == (0, 8) and dtensor.fetch_layout(out).is_fully_replicated()
    assert _runtime.gather_lowering_is_collective() == lowering  # the switch is back for other programs


def test_a_gather_over_two_mesh_dims_tf_cannot_lower_is_expanded_with_its_all_reduce_lowering(tf_mesh):
    """A relayout gathering both mesh dims of ``(dp, tp, -)`` at once: TF's CollectiveGatherV2
    lowering fails to compile it (docs/tf_dtensor_repros/all_gather_two_mesh_dims.py); the
    legalizer expands that program again with TF's all-reduce lowering."""
    from tfdist import _runtime

    if not _runtime.gather_lowering_is_collective():
        pytest.skip("TFDIST_GATHER_LOWERING=reduce: TF's default lowering, which compiles it")
    v = RNG.standard_normal((4, 8, 4)).astype(np.float32)
    x = _put(tf_mesh, v, "dp", "tp", U)

    def gather(t):
        return dtensor.relayout(t, dtensor.Layout.replicated(tf_mesh, 3))

    with pytest.raises(tf.errors.OpError) as refused:
        _as_tf_expands(gather, x)
    assert _legalize.gather_lowering_failed(refused.value)
    legalizer = _legalize.Legalizer(tf.function(gather))
    np.testing.assert_array_equal(dtensor.unpack(legalizer(x))[0].numpy(), v)
    assert legalizer.gathers_by_all_reduce and _runtime.gather_lowering_is_collective()  # switched back after
