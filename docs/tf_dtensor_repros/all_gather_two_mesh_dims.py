"""TF DTensor (2.21) mis-lowers a relayout that all-gathers two mesh dims at once
when CollectiveGatherV2 lowering is on: a compile error, or silently wrong values.

    python docs/tf_dtensor_repros/all_gather_two_mesh_dims.py

TF lowers an all-gather to an all-reduce of a zero-padded buffer (2x the
bytes) unless LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2 is set
(tensorflow/dtensor/cc/dtensor_utils.cc reads it by that exact name).  With
it set, gathering one mesh dim per relayout emits CollectiveGatherV2 and is
right; gathering two at once either fails ("'tf.Reshape' op requires
'output' number of elements to match", layout (dp, -, tp)) or returns wrong
values with no error (layout (tp, dp)).  tfdist enables the switch and
gathers one mesh dim per relayout (as torch plans it); set
TFDIST_GATHER_LOWERING=reduce to keep TF's default.  Exit status 1 when the
bug reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"] = "1"
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor  # noqa: E402

mesh = dtensor.create_mesh([("dp", 2), ("tp", 4)], device_type="CPU")
U = dtensor.UNSHARDED
v = np.arange(4 * 8 * 4, dtype=np.float32).reshape(4, 8, 4)
x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(v), dtensor.Layout.replicated(mesh, 3)),
                     dtensor.Layout(["dp", "tp", U], mesh))
one_at_a_time = dtensor.relayout(dtensor.relayout(x, dtensor.Layout([U, "tp", U], mesh)),
                                 dtensor.Layout.replicated(mesh, 3))
assert np.array_equal(dtensor.unpack(one_at_a_time)[0].numpy(), v)
failed = False
try:
    dtensor.relayout(x, dtensor.Layout.replicated(mesh, 3))
except (tf.errors.UnknownError, tf.errors.InternalError) as err:
    print("gathering dp and tp of (dp, -, tp) in one relayout failed:", str(err).splitlines()[0][:100])
    failed = True
m = np.arange(16 * 16, dtype=np.float32).reshape(16, 16)
y = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(m), dtensor.Layout.replicated(mesh, 2)),
                     dtensor.Layout(["tp", "dp"], mesh))
wrong = not np.array_equal(dtensor.unpack(dtensor.relayout(y, dtensor.Layout.replicated(mesh, 2)))[0].numpy(), m)
print("gathering (tp, dp) in one relayout gives", "WRONG values, no error" if wrong else "the right values")
sys.exit(1 if failed or wrong else 0)
