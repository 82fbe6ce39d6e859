"""TF DTensor's *parted* layouts hold a different value per device, and TF computes with them as such.

    python docs/tf_dtensor_repros/parted_layout_per_device_values.py

The route for what needs per-device values that a static layout cannot hold
(local SGD's diverging replicas, HSDP's replicas of different batches): a
static ``Replicate`` layout promises equal copies, and TF reads one of them
(``dtensor.pack`` of 0..7 under a replicated layout sums to 0).  A parted
layout (``Layout.to_parted()``, "axes treated as independent by most SPMD
expanders", ``tensorflow/dtensor/python/layout.py``) does not: checked here,

1. a sum over a parted-sharded dim stays on each device (no all-reduce): device
   d keeps its own value;
2. the gradient of a loss on parted data with respect to a *replicated*
   variable comes out parted: each device's own local gradient (what local
   SGD steps with), not TF's all-reduced one;
3. per-device values become a real sharded tensor again (broadcast against a
   parted ``[N, ...]`` carrier, relayout to the static layout), whose mean is
   one all-reduce: the periodic average of local SGD.

Exit status 0 when all three hold (TF 2.21).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor  # noqa: E402

mesh = dtensor.create_mesh([("dp", 8)], device_type="CPU")
static = dtensor.Layout(["dp", dtensor.UNSHARDED], mesh)
parted = static.to_parted()
x = dtensor.pack([tf.fill([1, 3], float(d)) for d in range(8)], parted)  # device d holds d
w = dtensor.DVariable(dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(mesh, 1), shape=[3]))


def components(t):
    return [float(c.numpy().ravel()[0]) for c in dtensor.unpack(t)]


local_sum = tf.function(lambda x: tf.reduce_sum(x, axis=0) * 2.0)(x)


@tf.function
def local_grad(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * w)
    return tape.gradient(loss, w)


@tf.function
def average_of_local_values(x):
    own = tf.reduce_sum(x, axis=0) * 2.0                    # per device: 2d (parted, unsharded)
    stacked = tf.expand_dims(own, 0) + x * 0.0               # [8, 3] parted on dp: row d on device d
    return tf.reduce_mean(dtensor.relayout(stacked, static), axis=0)   # static: one all-reduce


checks = {
    "a sum over a parted dim stays per device": components(local_sum) == [2.0 * d for d in range(8)],
    "gradient w.r.t. a replicated variable is per device": components(local_grad(x)) == [float(d) for d in range(8)],
    "per-device values average with one all-reduce": components(average_of_local_values(x)) == [7.0] * 8,
}
for what, ok in checks.items():
    print(f"{what}: {'yes' if ok else 'NO'}")
sys.exit(0 if all(checks.values()) else 1)
