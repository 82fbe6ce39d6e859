"""Regression guard: the step program Keras fit runs on tfdist holds no work the same step
written by hand in TF DTensor does not need.  Compared on the traced graphs (op counts of
the compute-heavy ops) and on what TF executes (collectives and the bytes they send, read by
CommDebugMode from the executed programs) -- not on time."""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist.keras  # noqa: F401  (the Keras plug-in)
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.keras import _data
from tfdist.keras._trainer import mesh_of
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.debug._executed import combined_all_reduce_pieces, partition_graphs

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 16)).astype(np.float32)
Y = RNG.standard_normal((64, 8)).astype(np.float32)
LR = 0.1
HEAVY = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D")


def _mlp(name: str | None = None):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up"),
                             keras.layers.Dense(8, name="down")], name=name)


def _fit_one_step(distribution):
    keras.distribution.set_distribution(distribution)
    model = _mlp()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    start = [v.numpy() for v in model.trainable_variables]
    model.fit(X, Y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    mesh, batch_axis = mesh_of(model)
    data = _data.shard_batch((X, Y), mesh, batch_axis)
    return model, model.train_function.one_step.traced[0], data, start


def _hand_written(start, layouts, mesh):
    """The same step in raw TF DTensor: the MLP, mean squared error, SGD."""
    ws = [dtensor.DVariable(dtensor.relayout(
        dtensor.copy_to_mesh(tf.constant(w), dtensor.Layout.replicated(mesh, w.ndim)), layout))
        for w, layout in zip(start, layouts)]
    batch = dtensor.Layout.batch_sharded(mesh, "batch", 2)
    xb, yb = (dtensor.relayout(dtensor.copy_to_mesh(tf.constant(a), dtensor.Layout.replicated(mesh, 2)), batch)
              for a in (X, Y))

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            out = tf.nn.relu(xb @ ws[0] + ws[1]) @ ws[2] + ws[3]
            loss = tf.reduce_mean(tf.square(out - yb))
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(LR * g)
        return loss

    return step, (xb, yb)


def _heavy_ops(fn, *args) -> collections.Counter:
    graph = fn.get_concrete_function(*args).graph
    return collections.Counter(op.type for op in graph.get_operations() if op.type in HEAVY)


def _executed(fn, *args):
    fn(*args)
    with CommDebugMode() as comm:
        fn(*args)
    return comm.get_comm_counts(), sum(comm.get_comm_bytes().values())


SCALARS = 64  # bytes: a few scalar metrics (loss tracker) may travel beside the step's own


@pytest.mark.parametrize("kind", ["data_parallel", "tensor_parallel"])
def test_fit_step_runs_no_more_compute_or_communication_than_the_hand_written_step(kind):
    if kind == "data_parallel":
        distribution = keras.distribution.DataParallel()
        mesh = dtensor.create_mesh([("batch", 8)], devices=[f"CPU:{i}" for i in range(8)])
        specs = [[dtensor.UNSHARDED] * 2, [dtensor.UNSHARDED], [dtensor.UNSHARDED] * 2, [dtensor.UNSHARDED]]
    else:
        device_mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layout_map[".*up/kernel"] = (None, "model")
        layout_map[".*up/bias"] = ("model",)
        layout_map[".*down/kernel"] = ("model", None)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
        U = dtensor.UNSHARDED
        specs = [[U, "model"], ["model"], ["model", U], [U]]
    model, fit_step, data, start = _fit_one_step(distribution)
    hand, hand_args = _hand_written(start, [dtensor.Layout(s, mesh) for s in specs], mesh)

    assert _heavy_ops(fit_step, data) == _heavy_ops(hand, *hand_args)
    fit_counts, fit_bytes = _executed(fit_step, data)
    hand_counts, hand_bytes = _executed(hand, *hand_args)
    # both steps reduce gradients over the batch dim: a trace that lost them would compare nothing
    assert fit_counts.get("all_reduce") and hand_counts.get("all_reduce"), (fit_counts, hand_counts)
    assert fit_bytes <= hand_bytes + SCALARS, (fit_counts, fit_bytes, hand_counts, hand_bytes)
    assert sum(fit_counts.values()) <= sum(hand_counts.values()), (fit_counts, hand_counts)


@pytest.mark.parametrize("kind", ["data_parallel", "tensor_parallel"])
def test_fit_step_slices_every_gradient_out_of_the_combined_all_reduce_aligned(kind):
    """TF DTensor packs a fit step's independent all-reduces into one flat buffer (its combine pass,
    which tfdist enables for Keras' train and test steps, docs/design.md) and slices each tensor back
    out; a slice that starts off a 64-byte boundary is a copy (TF shares aligned ones).  Keras' mean
    loss, reduced as a sum, would lead that buffer as one float and shift every gradient by 4 bytes;
    tfdist reduces it as a mean (its own all-reduce), so with layer sizes that are multiples of 16
    floats every gradient starts aligned."""
    if kind == "data_parallel":
        distribution = keras.distribution.DataParallel()
        grads = {"up/kernel": 16 * 64, "up/bias": 64, "down/kernel": 64 * 16, "down/bias": 16}
    else:
        layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 4), ["batch", "model"]))
        layout_map[".*up/kernel"] = (None, "model")
        layout_map[".*up/bias"] = ("model",)
        layout_map[".*down/kernel"] = ("model", None)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        grads = {"up/kernel": 16 * 64 // 4, "up/bias": 64 // 4, "down/kernel": 64 // 4 * 16, "down/bias": 16}
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu", name="up"),
                              keras.layers.Dense(16, name="down")])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    target = np.tanh(X)
    model.fit(X, target, batch_size=64, epochs=1, verbose=0, shuffle=False)
    mesh, batch_axis = mesh_of(model)
    program = model.train_function.one_step.traced[0].get_concrete_function(
        _data.shard_batch((X, target), mesh, batch_axis))

    pieces = combined_all_reduce_pieces(program)
    sliced = {re.sub(r"_\d+$", "", name.split("/")[2]) + ("/bias" if "BiasAdd" in name else "/kernel"): size
              for name, _, size in pieces if name.startswith("gradient_tape/")}
    assert sliced == grads, pieces  # the four gradients, reduced over the batch in one buffer
    assert not [p for p in pieces if not p[0].startswith("gradient_tape/")], pieces  # the loss is not in it
    assert not [p for p in pieces if p[1] * 4 % 64], pieces


def test_steps_go_through_one_concrete_program_per_batch_signature():
    """fit calls the step's concrete function for each batch signature (not tf.function's
    per-call lookup); another shape, structure or Python value gets its own, and values it
    cannot key (composite tensors) go through the tf.function as before."""
    from tfdist.keras._trainer import _through_concrete

    def step(data):
        if isinstance(data, dict):
            return data["a"] * 2.0 + data["b"]
        x, scale = data
        if isinstance(x, tf.SparseTensor):
            return tf.sparse.reduce_sum(x) * scale
        return tf.reduce_sum(x, axis=0) * scale

    function = tf.function(step, reduce_retracing=True)
    lookups = []
    concrete = function.get_concrete_function

    class Spy:
        def get_concrete_function(self, data):
            lookups.append(1)
            return concrete(data)

        def __call__(self, data):
            return function(data)

    call = _through_concrete(Spy())
    batches = [(tf.constant(X[:4]), 2.0), (tf.constant(X[4:8]), 2.0), (tf.constant(X[:6]), 2.0),
               (tf.constant(X[:4]), 3.0), {"a": tf.constant(X[:4]), "b": tf.constant(X[4:8])},
               (tf.constant(X[8:12]), 2.0)]
    for data in batches:
        np.testing.assert_allclose(call(data).numpy(), step(data).numpy(), rtol=1e-6)
    assert len(lookups) == 4  # (4,16)x2.0, (6,16)x2.0, (4,16)x3.0, the dict; repeats reuse theirs
    sparse = tf.sparse.from_dense(tf.constant(X[:2]))
    assert float(call((sparse, 2.0))) == pytest.approx(float(X[:2].sum() * 2.0), rel=1e-5)
    assert len(lookups) == 4


def test_concrete_programs_are_called_on_flat_tensors_with_their_captures_up_to_date():
    """The per-signature call skips TensorFlow's argument binding: each step hands the flat
    tensors of the batch (dict keys in tf.nest order, None and Python values left out) to the
    concrete program.  Captured variables are the same handles every step, so their updates
    are seen; a capture resolved per call is resolved per call (that program keeps
    ``__call__``)."""
    from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction

    from tfdist.keras._trainer import _through_concrete

    counter = tf.Variable(0.0)

    def step(data):
        counter.assign_add(1.0)
        if isinstance(data, dict):
            return data["z"] * 10.0 - data["a"] + counter
        x, weight, scale = data
        return tf.reduce_sum(x, axis=0) * scale + (0.0 if weight is None else tf.reduce_sum(weight)) + counter

    call = _through_concrete(tf.function(step))
    a, z = tf.constant(X[:4]), tf.constant(X[4:8])
    for i in range(1, 4):
        got = call((a, None, 2.0)).numpy()
        np.testing.assert_allclose(got, X[:4].sum(0) * 2.0 + i, rtol=1e-6)
    got = call({"z": z, "a": a}).numpy()  # inserted out of tf.nest's (sorted) key order
    np.testing.assert_allclose(got, X[4:8] * 10.0 - X[:4] + 4.0, rtol=1e-6)
    got = call((a, tf.constant([1.0, 2.0]), 1.0)).numpy()
    np.testing.assert_allclose(got, X[:4].sum(0) + 3.0 + 5.0, rtol=1e-6)
    assert len(call.programs) == 3
    assert not any(isinstance(p, ConcreteFunction) for p in call.programs.values())

    offset = [1.0]

    @tf.function
    def late(x):
        graph = tf.compat.v1.get_default_graph()
        return x + graph.capture_call_time_value(lambda: tf.constant(offset[0]), tf.TensorSpec([], tf.float32))

    late_call = _through_concrete(late)
    assert float(late_call(tf.constant(1.0))) == 2.0
    offset[0] = 5.0
    assert float(late_call(tf.constant(1.0))) == 6.0
    assert all(isinstance(p, ConcreteFunction) for p in late_call.programs.values())


def _executed_op_counts(run, scope: str | None = None) -> collections.Counter:
    """Op types of the partition graphs TF executed while ``run()`` ran (after Grappler); with
    ``scope``, of those holding a node of that name scope, which must be the program's own: TF's
    run metadata may also hold graphs an earlier test instantiated, and Keras' automatic model
    names repeat across tests (an earlier test's ``sequential_1``, its step called with Grappler's
    fused matmuls, made the CPU-mesh test below fail when other files ran first)."""
    graphs = [g for g in partition_graphs(run) if scope is None or any(scope in n.name for n in g.node)]
    return collections.Counter(node.op for graph in graphs for node in graph.node)


def _matmuls(counts: collections.Counter) -> tuple[int, int]:
    """(plain, fused) matmul kernels.  TF builds with oneDNN rewrite MatMul to _MklMatMul and the
    fused one to _MklFusedMatMul / _MklNativeFusedMatMul (a graph pass that runs with or without
    Grappler, on CPUs where oneDNN is on); the counts cover both spellings."""
    plain = sum(n for op, n in counts.items() if op.endswith("MatMul") and "Fused" not in op and "Batch" not in op)
    fused = sum(n for op, n in counts.items() if op.endswith("FusedMatMul"))
    return plain, fused


def test_cpu_mesh_step_programs_run_only_grapplers_arithmetic_pass_while_plain_code_keeps_all():
    """Grappler's remapper fuses MatMul + BiasAdd (+ Relu) into _FusedMatMul on CPU; a step on a
    CPU mesh is called with only Grappler's arithmetic optimizer (keras/_trainer._program_options):
    no fused matmul, and the approximate GELU's ``Pow(x, 3)`` runs as multiplications. Plain TF
    code in the same process and thread still gets every pass."""
    from tensorflow.python.eager import context

    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 4), ["batch", "model"])),
        batch_dim_name="batch"))
    keras.utils.set_random_seed(0)
    gelu = keras.layers.Activation(lambda x: keras.activations.gelu(x, approximate=True))
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up"), gelu,
                              keras.layers.Dense(8, name="down")], name="grappler_probe")
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    before = context.context().function_call_options
    distributed = _executed_op_counts(lambda: model.fit(X, Y, batch_size=64, epochs=1, verbose=0), model.name)
    plain_matmuls, fused_matmuls = _matmuls(distributed)
    assert plain_matmuls > 0 and fused_matmuls == 0, distributed
    assert distributed["Pow"] == 0 and distributed["Square"] > 0, distributed
    assert context.context().function_call_options is before  # the thread's options are back

    @tf.function
    def plain(x, w, b):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))

    fused = _executed_op_counts(lambda: plain(tf.ones((4, 16)), tf.ones((16, 32)), tf.ones((32,))))
    assert _matmuls(fused)[1] == 1, fused


def test_grappler_is_kept_for_gpu_and_tpu_meshes():
    """The choice follows the mesh's device type: GPU/TPU programs keep Grappler's layout and
    fusion passes (no GPU here: a mesh of GPU device names is enough to select the path)."""
    from tfdist.device_mesh import DeviceMesh
    from tfdist.keras._trainer import _program_options

    for kind in ("GPU", "TPU"):
        devices = [f"/job:localhost/replica:0/task:0/device:{kind}:{i}" for i in range(2)]
        mesh = DeviceMesh.from_tf(dtensor.Mesh(["x"], np.arange(2), [0, 1], devices))
        assert _program_options(mesh) is contextlib.nullcontext
    cpu = DeviceMesh.from_tf(dtensor.create_mesh([("x", 8)], device_type="CPU"))
    assert _program_options(cpu) is not contextlib.nullcontext


@pytest.mark.slow
def test_tf_xla_autoclustering_still_fails_on_dtensor_relayouts():
    """Why tfdist does not switch XLA auto-clustering on for CPU meshes (docs/design.md): when TF
    fixes it, this fails and the route can be measured again."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "docs" / "tf_dtensor_repros" / "xla_autoclustering_multiple_cpu_devices.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert "training step: Multiple CPU devices" in out.stdout


@pytest.mark.slow
def test_tf_dtensor_still_refuses_a_callee_kept_out_of_inlining():
    """Why XLA cannot get a callee of a step on a CPU/GPU mesh after DTensor's expansion
    (docs/design.md): a call kept with ``_noinline`` fails mesh clustering, with or without
    ``_mesh`` and ``_XlaMustCompile`` on the call. When TF changes that, this fails."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "docs" / "tf_dtensor_repros" / "noinline_callee_on_a_mesh.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert out.stdout.count("cluster does not have mesh attribute") == 3, out.stdout


@pytest.mark.slow
def test_tf_dtensor_xla_spmd_mode_still_runs_unpartitioned_on_a_cpu_mesh():
    """Why tfdist does not build CPU/GPU meshes in DTensor's XLA SPMD mode (docs/design.md): each
    device holds and computes the global tensor, uncompiled. When TF changes that, this fails."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "docs" / "tf_dtensor_repros" / "xla_spmd_on_a_cpu_mesh.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert "{(16, 64)}" in out.stdout and "0 XLA launches" in out.stdout


class _FlipIfNegative(keras.Sequential):
    """A custom ``train_step`` with a Python ``if`` on a tensor's value: plain Python cannot
    trace it (TF refuses a graph tensor as a bool); autograph would turn it into a ``tf.cond``.
    (Autograph stops at Keras' own functions, so the step a user or a library like keras-hub
    writes is what it converts.)"""

    def train_step(self, data):
        x, y = data
        if keras.ops.sum(x) < 0:
            x = -x
        return super().train_step((x, y))


def _fit_flip_model():
    model = _FlipIfNegative([keras.Input((16,)), keras.layers.Dense(8)])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return model.fit(X, Y, batch_size=16, epochs=1, verbose=0, shuffle=False)


def test_step_runs_the_models_python_as_keras_traces_it():
    """Keras' TF trainer traces its step with autograph off (``do_not_convert``), so a custom
    step's Python ``if`` on a tensor fails on one device; on a mesh it fails the same way (with
    autograph on, tfdist's step converted it and trained)."""
    keras.distribution.set_distribution(None)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError) as one_device:
        _fit_flip_model()
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        device_mesh=keras.distribution.DeviceMesh((8,), ["batch"])))
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError) as on_mesh:
        _fit_flip_model()
    assert "bool" in str(one_device.value) and "bool" in str(on_mesh.value)


def test_run_eagerly_on_a_mesh_takes_the_sgd_step_numpy_takes(no_global_distribution):
    """``run_eagerly=True`` on a mesh runs the step op by op; its loss and weights after one
    full-batch SGD step match the same step in numpy."""
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, use_bias=False)])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", run_eagerly=True)
    w0 = model.trainable_variables[0].numpy()
    history = model.fit(X, Y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    residual = X @ w0 - Y
    np.testing.assert_allclose(history.history["loss"][0], np.mean(residual ** 2), rtol=1e-5)
    want = w0 - LR * 2.0 * X.T @ residual / residual.size
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), want, rtol=1e-4, atol=1e-6)
