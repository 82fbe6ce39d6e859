"""TF DTensor (2.21): the gradient of a tf.function, taken by an eager tape, fails to compile when two
of its all-reduces are combined: "missing result layout attribute for function".

    python docs/tf_dtensor_repros/combined_all_reduce_returned_without_layout.py          # fails
    DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0 python docs/tf_dtensor_repros/...   # works

Two replicated variables, a batch sharded over the mesh, one tf.function and an eager
``tf.GradientTape``: the backward function TF builds for the tf.function returns both variables'
gradients, each the all-reduce of the per-device partial sums.  DTensor's all-reduce combine pass
(tensorflow/dtensor/mlir/dtensor_allreduce_combine_optimization.cc, MergeAllReduceGroup) packs the two
into one buffer and replaces each result with a ``tf.Slice`` + ``tf.Reshape`` it gives no ``_layout``;
when such a result is what the function returns, cluster_function_conversion.cc (AttachRetvalLayouts)
finds no layout for it and refuses the function.  A Keras train step never returns a gradient (the
optimizer consumes it inside the program), so only programs that hand gradients back fail: every eager
tape over a DTensor tf.function, and so every pipeline stage's backward.  The pass is switched off by
``DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0`` (dtensor_mlir_passes.cc reads it by that name
when the DTensor device builds its pass pipeline, once per process); tfdist sets it.  Exit status 1 when
the bug reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
from tensorflow.experimental import dtensor  # noqa: E402

mesh = dtensor.create_mesh([("dp", 4)], device_type="CPU")
replicated = dtensor.Layout.replicated(mesh, 2)
w1 = dtensor.DVariable(dtensor.call_with_layout(tf.ones, replicated, shape=(8, 4)))
w2 = dtensor.DVariable(dtensor.call_with_layout(tf.ones, replicated, shape=(8, 4)))
x = dtensor.call_with_layout(tf.ones, dtensor.Layout.batch_sharded(mesh, "dp", 2), shape=(16, 8))


@tf.function
def loss_fn(x):
    return tf.reduce_sum(x @ w1) + tf.reduce_sum(tf.tanh(x @ w2))


with tf.GradientTape() as tape:
    loss = loss_fn(x)
try:
    g1, _ = tape.gradient(loss, [w1, w2])
except tf.errors.UnknownError as e:
    line = next(ln for ln in str(e).splitlines() if "missing result layout" in ln)
    print("BUG REPRODUCED:", line.strip())
    sys.exit(1)
total = float(tf.reduce_sum(dtensor.unpack(g1)[0]))
print(f"works: d loss / d w1 sums to {total} (16 rows of ones x 8 x 4 = 512)")
