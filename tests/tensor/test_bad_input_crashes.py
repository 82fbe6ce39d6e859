"""Inputs that used to crash or poison the process get a clear error, and the process stays usable.

Each case runs in a fresh subprocess (a crash there cannot take the test
run down) and then does a valid round trip in the same process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from conftest import make_mesh
from tfdist.tensor import DTensor, Replicate, Shard, distribute_tensor

PRELUDE = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
import tfdist
tfdist.virtual_cpus(8)
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))
def round_trip():
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    d = DTensor.from_local([tf.constant(x[i:i + 1]) for i in range(8)], mesh, [Partial()], shape=(1, 2))
    assert np.array_equal(d.full_tensor().numpy(), x.sum(0, keepdims=True))
    assert np.array_equal(distribute_tensor(x, mesh, [Shard(0)]).full_tensor().numpy(), x)
"""

CASES = {
    "f32 + f64 DTensors": ("a = distribute_tensor(np.ones(8, np.float32), mesh, [Shard(0)]); "
                           "b = distribute_tensor(np.ones(8), mesh, [Shard(0)]); a + b", TypeError, "one dtype"),
    "f32 + f64 scalar tensor": ("a = distribute_tensor(np.ones(8, np.float32), mesh, [Shard(0)]); "
                                "a + tf.constant(1.0, tf.float64)", TypeError, "float32 and float64"),
    "int32 + f32": ("a = distribute_tensor(np.ones(8, np.int32), mesh, [Shard(0)]); "
                    "b = distribute_tensor(np.ones(8, np.float32), mesh, [Shard(0)]); a + b", TypeError, "one dtype"),
    "f32 @ f64": ("a = distribute_tensor(np.ones((8, 8), np.float32), mesh, [Shard(0)]); "
                  "b = distribute_tensor(np.ones((8, 8)), mesh, [Replicate()]); a @ b", TypeError, "one dtype"),
    "rank 9": ("distribute_tensor(np.zeros([2] * 9, np.float32), mesh, [Shard(0)])", ValueError,
               "more than the 8"),
    "rank 10 even": ("distribute_tensor(np.zeros([8] + [1] * 9, np.float32), mesh, [Shard(0)])", ValueError,
                     "more than the 8"),
    "from_local([])": ("DTensor.from_local([], mesh)", ValueError, "empty list"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_and_process_stays_usable(name):
    statement, error, text = CASES[name]
    code = PRELUDE + textwrap.dedent(f"""
    try:
        {statement}
    except {error.__name__} as err:
        assert {text!r} in str(err), str(err)
    else:
        raise SystemExit("no error")
    round_trip()
    print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-1500:])


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("placements", [(Shard(0), Replicate()), (Shard(0), Shard(0)), (Shard(1), Shard(0))], ids=str)
def test_empty_tensors_work(placements, graph):
    """Empty sharded tensors are valid (torch); no collective runs on them (TF's would abort)."""
    mesh = make_mesh((2, 4))
    x = np.zeros((0, 4), np.float32)
    d = distribute_tensor(x, mesh, placements)
    full = (tf.function(lambda t: t.full_tensor()) if graph else (lambda t: t.full_tensor()))(d)
    assert tuple(full.shape) == (0, 4)
    moved = d.redistribute(mesh, [Replicate(), Shard(1)])
    assert tuple(moved.shape) == (0, 4) and all(t.shape[0] == 0 for t in moved.local_tensors())
    y = distribute_tensor(np.arange(8, dtype=np.float32), mesh, [Shard(0), Replicate()])
    np.testing.assert_array_equal(y.full_tensor().numpy(), np.arange(8))  # collectives still work


def test_equality_is_elementwise():
    mesh = make_mesh((8,))
    a = distribute_tensor(np.arange(8.0), mesh, [Shard(0)])
    b = distribute_tensor(np.array([0, 9, 2, 9, 4, 9, 6, 9.0]), mesh, [Shard(0)])
    eq, ne = a == b, a != b
    assert isinstance(eq, DTensor) and tuple(eq.placements) == (Shard(0),)
    np.testing.assert_array_equal(eq.numpy(), np.arange(8) % 2 == 0)
    np.testing.assert_array_equal(ne.numpy(), np.arange(8) % 2 == 1)
    np.testing.assert_array_equal((a == 3.0).numpy(), np.arange(8) == 3)


def test_loss_parallel_edges_match_tf():
    """-inf logits of other classes stay finite; bad labels raise as TF's kernel does."""
    from tfdist.tensor.parallel import loss_parallel

    logits = tf.constant([[0.5, -np.inf, 2.0], [1.0, 0.0, -np.inf]])
    labels = tf.constant([2, 0])
    want = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits).numpy()
    with loss_parallel():
        got = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert np.isfinite(got).all()
        with pytest.raises(tf.errors.InvalidArgumentError, match="label value of 3"):
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.constant([3, 0]), logits=logits)
        with pytest.raises(tf.errors.InvalidArgumentError, match="label value of -1"):
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.constant([-1, 0]), logits=logits)
        with pytest.raises(TypeError, match="integer class labels"):
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.constant([2.0, 0.0]), logits=logits)


def test_loss_parallel_out_of_range_labels_in_a_graph_are_nan_rows():
    """Inside tf.function an error would poison TF's collective executor: TF's GPU kernel's
    answer instead -- NaN loss and gradient for the bad rows, the others exact."""
    from tfdist.tensor.parallel import loss_parallel

    logits = tf.constant([[0.5, 1.0, 2.0], [1.0, 0.0, 3.0], [0.1, 0.2, 0.3]])
    labels = tf.constant([2, 3, -1])
    good = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=[2], logits=logits[:1]).numpy()

    @tf.function
    def loss_and_grad(logits, labels):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            with loss_parallel():
                loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return loss, tape.gradient(loss, logits)

    loss, grad = loss_and_grad(logits, labels)
    np.testing.assert_allclose(loss.numpy()[0], good[0], rtol=1e-6)
    assert np.isnan(loss.numpy()[1:]).all() and np.isnan(grad.numpy()[1:]).all()
    assert np.isfinite(grad.numpy()[0]).all()


def test_style_and_layout_map_arguments_are_checked():
    import keras

    import tfdist.keras
    from tfdist.tensor.parallel import ColwiseParallel

    with pytest.raises(TypeError, match="Received: 'bogus'"):
        ColwiseParallel(input_layouts="bogus")
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = tfdist.keras.LayoutMap(mesh)
    layout_map[".*kernel"] = (Replicate(), Shard(5))
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    try:
        with pytest.raises(ValueError, match=r"Shard\(dim=5\) is out of range for a rank-2 variable"):
            keras.layers.Dense(4).build((None, 8))
    finally:
        keras.distribution.set_distribution(None)


def test_unknown_batch_dim_name_is_an_error():
    import keras

    import tfdist.keras  # noqa: F401

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="bacth"))
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(ValueError, match="batch_dim_name 'bacth' is not a dim of the mesh"):
            model.fit(np.ones((16, 8), np.float32), np.ones((16, 4), np.float32), batch_size=8, verbose=0)
    finally:
        keras.distribution.set_distribution(None)


def test_clear_messages_for_common_mistakes():
    mesh = make_mesh((2, 4))
    a = distribute_tensor(np.ones((8, 4), np.float32), mesh, [Shard(0), Replicate()])
    b = distribute_tensor(np.ones((8, 4), np.float32), mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match=r"contracted dims differ \(4 vs 8\)"):
        a @ b
    np.testing.assert_array_equal(tf.matmul(a, b, transpose_b=True).full_tensor().numpy(), np.full((8, 8), 4.0))
    import tfdist

    with pytest.raises(ValueError, match="found no GPU device on this host"):
        tfdist.init_device_mesh("cuda", (8,))


def test_virtual_cpus_names_the_launcher_flag():
    code = PRELUDE.replace("tfdist.virtual_cpus(8)", "tfdist.virtual_cpus(2)") + textwrap.dedent("""
    try:
        tfdist.virtual_cpus(8)
    except ValueError as err:
        assert "--devices-per-proc 2" in str(err), str(err)
        print("ok")
    """)
    code = code.replace('mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))', "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TFDIST_VIRTUAL_CPUS": "2"})
    assert out.stdout.strip().endswith("ok"), out.stderr[-1500:]
