"""TF DTensor (2.21) all-to-all relayouts of rank-4 tensors on a 2-D mesh give wrong values.

    python docs/tf_dtensor_repros/all_to_all_wrong_values.py

A [4, 4, 8, 4] tensor with layout (dp, tp, -, -) relayouted to (dp, -, tp, -)
-- mesh dim tp moves from tensor dim 1 to dim 2 while dp stays on dim 0, one
all-to-all -- holds the wrong block on every device (no error is raised).
In a sweep over rank-4 shapes on a 2x4 mesh (see docs/design.md) every wrong
case moved a mesh dim between two tensor dims that are both not dim 0; moves
to or from dim 0 were always right, and rank <= 3 was always right.  tfdist
therefore transposes the two dims to the front, moves, and transposes back
(tfdist/tensor/_redistribute/_moves.py, ``move_mesh_dim``).  Exit status 1 when the
bug reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor  # noqa: E402

mesh = dtensor.create_mesh([("dp", 2), ("tp", 4)], device_type="CPU")
U = dtensor.UNSHARDED
v = np.arange(4 * 4 * 8 * 4, dtype=np.float32).reshape(4, 4, 8, 4)
x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(v), dtensor.Layout.replicated(mesh, 4)),
                     dtensor.Layout(["dp", "tp", U, U], mesh))
y = dtensor.relayout(x, dtensor.Layout(["dp", U, "tp", U], mesh))
wrong = 0
for device, block in enumerate(dtensor.unpack(y)):
    i, j = divmod(device, 4)
    expected = v[2 * i:2 * i + 2, :, 2 * j:2 * j + 2, :]
    wrong += not np.array_equal(block.numpy(), expected)
print(f"devices holding a wrong block after the all-to-all: {wrong} of 8")
sys.exit(1 if wrong else 0)
