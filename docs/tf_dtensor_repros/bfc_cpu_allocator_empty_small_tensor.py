"""TF DTensor (2.21) fails on an empty small integer tensor when TF's CPU allocator is its BFC
pool (TF_CPU_ALLOCATOR_USE_BFC=1): "TF_TensorData returned nullptr".

    python docs/tf_dtensor_repros/bfc_cpu_allocator_empty_small_tensor.py

TF DTensor keeps small integer tensors (shapes, indices) as host values and reads their data;
TF's BFC allocator hands out no buffer for zero bytes, so an op whose integer result is empty
fails: the ``BroadcastGradientArgs`` of every eager gradient of an elementwise op on equal
shapes, an empty slice of a shape.  With TF's default CPU allocator both run.  The
pool made keras-hub Gemma's 2x4 step about 10% and its first epoch about 0.5 s shorter here
(docs/design.md), so tfdist does not turn it on: it would break eager gradients on a mesh.
Run it as it is (the pool on); exit status 1 when the bug reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")  # read when TF makes its CPU allocator
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
mesh = dtensor.create_mesh([("x", 2)], device_type="CPU")
shape = dtensor.copy_to_mesh(tf.constant([4, 2]), dtensor.Layout.replicated(mesh, 1))
failed = 0
for name, op in [("BroadcastGradientArgs of equal shapes", lambda: tf.raw_ops.BroadcastGradientArgs(s0=shape, s1=shape)),
                 ("an empty slice of a shape", lambda: shape[2:])]:
    try:
        op()
        print(f"{name}: runs")
    except tf.errors.InternalError as error:
        failed += 1
        print(f"{name}: {str(error).splitlines()[0]}")
print(f"TF_CPU_ALLOCATOR_USE_BFC={os.environ['TF_CPU_ALLOCATOR_USE_BFC']}: {failed} of 2 failed")
sys.exit(1 if failed else 0)
