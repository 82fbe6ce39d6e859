"""TF (2.21) DTensor's XLA SPMD mode on a CPU mesh neither partitions nor compiles.

    python docs/tf_dtensor_repros/xla_spmd_on_a_cpu_mesh.py

``dtensor.Mesh(..., use_xla_spmd=True)`` hands the SPMD partitioning of a program to XLA
instead of DTensor's own expansion. Its Python constructor refuses every device type but
TPU (``tensorflow/dtensor/python/layout.py``: ``if use_xla_spmd and device_type != 'TPU':
raise ValueError('XLA SPMD is not currently not supported for %s mesh.')``), but the C++
mesh underneath accepts the flag for CPUs. Built that way (the same call the Python
constructor makes after its check), a CPU mesh runs programs with correct values, but:

- every device holds the *global* tensor: a ``(16, 64)`` value laid out ``("x", UNSHARDED)``
  over 8 CPUs unpacks to eight ``(16, 64)`` components, not ``(2, 64)``;
- the per-device graphs TF runs are the whole, unpartitioned program (one ``MatMul`` of the
  global shapes on every device, ``XlaSharding`` annotations left as no-ops) and, even with
  ``jit_compile=True``, no XLA launch: nothing runs the XLA SPMD partitioner, which only the
  TPU path (``TPUPartitionedCall``) invokes.

So the mode gives neither sharded memory nor compiled per-device code on CPU/GPU: 8x the
compute of one device instead of a split of it. Exit status 1 while this holds.
"""

import collections
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python import _pywrap_dtensor_device
from tensorflow.python.eager import context

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor  # noqa: E402

devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
mesh = dtensor.Mesh.__new__(dtensor.Mesh)
# What dtensor.Mesh.__init__ calls after its TPU-only check.
_pywrap_dtensor_device.Mesh.__init__(mesh, "", ["x"], [8], list(range(8)), devices, list(range(8)), devices, True)
assert mesh.use_xla_spmd()
rows = dtensor.Layout(["x", dtensor.UNSHARDED], mesh)
replicated = dtensor.Layout.replicated(mesh, 2)
a_np = np.random.default_rng(0).random((16, 64), dtype=np.float32)
w_np = np.random.default_rng(1).random((64, 64), dtype=np.float32)
a = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(a_np), replicated), rows)
w = dtensor.copy_to_mesh(tf.constant(w_np), replicated)

component_shapes = {tuple(t.shape) for t in dtensor.unpack(a)}
print("components of a (16, 64) value laid out ('x', UNSHARDED) over 8 CPUs:", component_shapes)


def ops_run(jit_compile):
    @tf.function(jit_compile=jit_compile)
    def f(a, w):
        return tf.reduce_sum(tf.nn.relu(a @ w))

    ctx = context.context()
    ctx.enable_run_metadata()
    value = f(a, w)
    graphs = [g for fn in ctx.export_run_metadata().function_graphs for g in fn.partition_graphs]
    ctx.disable_run_metadata()
    ops = collections.Counter(n.op for g in graphs for n in g.node)
    assert np.isclose(float(value), np.maximum(a_np @ w_np, 0).sum(), rtol=1e-4)
    return ops, len(graphs)


for jit in (False, True):
    ops, n = ops_run(jit)
    xla = sum(ops[k] for k in ops if k.startswith("_Xla") or k == "XlaLaunch")
    print(f"jit_compile={jit}: {n} device graphs, {ops['MatMul']} MatMul, {xla} XLA launches, "
          f"{ops['XlaSharding']} XlaSharding no-ops")

sys.exit(1 if component_shapes == {(16, 64)} else 0)
