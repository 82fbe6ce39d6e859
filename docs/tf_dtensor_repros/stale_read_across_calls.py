"""Minimal reproduction: one tf.function that calls a step function twice reads, in the
second call, a DVariable value from before the first call's write, when the written value
comes from a cross-device reduction (TF 2.21, 8 virtual CPUs).

This is what fusing ``steps_per_execution`` Keras steps into one program does to Keras'
loss tracker: ``total = total + sum(loss)`` over 4 steps kept only the last step's term
(18.2 instead of ~100), while ``count`` (a constant increment) was right.  Each step on its
own is correct, and so are the same two calls made one after the other from Python.

The cause is TF DTensor's all-reduce combine pass (dtensor_allreduce_combine_optimization.cc): it moves
independent all-reduces next to the last of their group (``moveBefore``) judging independence by data
edges only, so a reduction moves past the variable write a later read depends on.  With the pass off
(``DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0``, which tfdist sets at import) both calls are right.

    python stale_read_across_calls.py                                              # reproduces
    DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0 python stale_read_across_calls.py   # right
Exit status 1 when the bug reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor as dt  # noqa: E402


def main() -> int:
    mesh = dt.create_mesh([("batch", 8)], devices=[f"CPU:{i}" for i in range(8)])
    scalar = dt.Layout.replicated(mesh, 0)
    total = dt.DVariable(dt.copy_to_mesh(tf.constant(0.0), scalar))
    count = dt.DVariable(dt.copy_to_mesh(tf.constant(0.0), scalar))
    rows = np.arange(32, dtype=np.float32).reshape(8, 4)  # sum 496
    x = dt.pack(tf.split(tf.constant(rows), 8), dt.Layout(["batch", dt.UNSHARDED], mesh))

    @tf.function
    def step(x):
        total.assign(total.read_value() + tf.reduce_sum(x))  # a reduction over the batch dim
        count.assign(count.read_value() + 1.0)
        return total.read_value()

    @tf.function
    def two_steps(a, b):
        step(a)
        return step(b)

    def value(v):
        return float(dt.unpack(v.read_value())[0])

    step(x)
    step(x)
    separate = (value(total), value(count))
    total.assign(dt.copy_to_mesh(tf.constant(0.0), scalar))
    count.assign(dt.copy_to_mesh(tf.constant(0.0), scalar))
    two_steps(x, x)
    fused = (value(total), value(count))
    print(f"two calls from Python: total={separate[0]} count={separate[1]}  (want 992, 2)")
    print(f"two calls in one tf.function: total={fused[0]} count={fused[1]}")
    if fused != separate:
        print("REPRODUCED: the second call read total from before the first call's write")
        return 1
    print("not reproduced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
