"""TF (2.21) XLA auto-clustering fails on a DTensor training step on CPUs:
"Multiple CPU devices [...CPU:1, ...CPU:0]".

    python docs/tf_dtensor_repros/xla_autoclustering_multiple_cpu_devices.py

XLA auto-clustering is switched on by TF_XLA_FLAGS, read once when TF starts
(``tensorflow/compiler/jit/flags.cc``; on CPU ``--tf_xla_cpu_global_jit`` is
needed besides ``--tf_xla_auto_jit=2``). TF DTensor expands a step into one
program per device; the local slice it emits for a replicated -> sharded move
(``DTensorAllScatterOp .../static_shaped_slice/begin``) computes its offsets
with a Cast and a Const placed on the mesh's first CPU, and the clustering pass
puts those into every device's cluster. ``InferDeviceForCluster``
(``tensorflow/compiler/jit/build_xla_ops_pass.cc``) then asks
``PickDeviceForXla`` for one device of a cluster whose nodes sit on two CPUs
and fails the whole call (``device_util.cc``: ``errors::Internal("Multiple CPU
devices ", ...)``). Tried around it (docs/design.md, "XLA for the per-device
programs"): ``--tf_xla_min_cluster_size=20`` lets a lone relayout run but not a
step; ``DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION=1`` lets this step run but not
keras-hub's Gemma; ``--tf_xla_ops_to_cluster=FUSIBLE`` lets Gemma run (same
losses) without clustering its matmuls, and is slower there.

Exit status 1 when the bug reproduces (any of: an eager relayout, the same
relayout traced, a small training step). The script re-runs itself with the flags
(they must be set before TF starts).
"""

import os
import subprocess
import sys

FLAGS = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit"

if os.environ.get("TF_XLA_FLAGS") != FLAGS:
    env = dict(os.environ, TF_XLA_FLAGS=FLAGS, TF_CPP_MIN_LOG_LEVEL="3")
    sys.exit(subprocess.run([sys.executable, __file__], env=env).returncode)

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor  # noqa: E402

mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], device_type="CPU")
U = dtensor.UNSHARDED
replicated = dtensor.Layout.replicated(mesh, 2)


@tf.function
def place(value, layout):
    return dtensor.relayout(value, layout)


def step(w, x):
    with tf.GradientTape() as tape:
        h = tf.matmul(x, w)
        for _ in range(3):
            h = tf.nn.gelu(h) * 1.5 + tf.sin(h)
        h = dtensor.relayout(h, dtensor.Layout(["batch", U], mesh))
        loss = tf.reduce_mean(h * h)
    w.assign_sub(0.1 * tape.gradient(loss, w))
    return loss


failures = []
for what, run in [
    # an eager relayout (replicated -> sharded: a local slice on every device)
    ("eager relayout", lambda: dtensor.relayout(dtensor.copy_to_mesh(tf.ones((64, 64)), replicated),
                                                dtensor.Layout([U, "model"], mesh))),
    # the same relayout traced
    ("traced relayout", lambda: place(dtensor.copy_to_mesh(tf.ones((64, 64)), replicated),
                                      dtensor.Layout([U, "model"], mesh))),
    # a training step whose variable and batch were placed without XLA's help
    ("training step", lambda: tf.function(step)(
        dtensor.DVariable(dtensor.call_with_layout(tf.ones, dtensor.Layout([U, "model"], mesh), shape=(64, 64))),
        dtensor.call_with_layout(tf.ones, dtensor.Layout(["batch", U], mesh), shape=(32, 64)))),
]:
    try:
        run()
        print(f"{what}: ran")
    except tf.errors.InternalError as e:
        failures.append(what)
        print(f"{what}: {str(e).splitlines()[0][:140]}")
sys.exit(1 if failures else 0)
