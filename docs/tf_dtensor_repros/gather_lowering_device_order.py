"""TF DTensor (2.21) with the CollectiveGatherV2 lowering puts gathered parts in
device order, not mesh order: on a mesh whose device ids fall along the
gathered dim, a relayout to replicated returns the rows swapped, silently.

    python docs/tf_dtensor_repros/gather_lowering_device_order.py

LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2 (tensorflow/dtensor/cc/
dtensor_utils.cc reads it by that exact name, at each lowering) makes DTensor
emit CollectiveGatherV2, which concatenates the group's parts by the rank TF's
collective executor gives each device (ascending task, then device index),
while DTensor meant the parts' mesh coordinates.  The same (2, 2) mesh over
CPU:2, CPU:3, CPU:0, CPU:1 (ids falling along dim "a") gathers right with TF's
default lowering (an all-reduce of a zero-padded buffer: position-based) and
wrong with the switch on; over CPU:0..3 both are right.  tfdist turns the
switch on for its bytes, so its DeviceMesh refuses device ids that do not
increase along every dim unless TFDIST_GATHER_LOWERING=reduce.
Exit status 1 when the bug reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
from tensorflow.experimental import dtensor  # noqa: E402

SWITCH = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"


def gathered(order: tuple[int, ...], rows: int) -> bool:
    """Shards a (rows, 2) tensor over dim "a" of a (2, 2) mesh on devices ``order``, gathers it back:
    whether the value is unchanged (``rows`` differs per call so each lowers afresh)."""
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in order]
    mesh = dtensor.Mesh(["a", "b"], np.arange(4).reshape(2, 2), list(range(4)), devices)
    v = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(v), dtensor.Layout.replicated(mesh, 2)),
                         dtensor.Layout(["a", dtensor.UNSHARDED], mesh))
    back = dtensor.relayout(x, dtensor.Layout.replicated(mesh, 2))
    return np.array_equal(dtensor.unpack(back)[0].numpy(), v)


os.environ.pop(SWITCH, None)
default_ok = gathered((2, 3, 0, 1), 4)
os.environ[SWITCH] = "1"
ascending_ok = gathered((0, 1, 2, 3), 6)
falling_ok = gathered((2, 3, 0, 1), 8)
print(f"TF's default lowering, devices (2, 3, 0, 1): {'right' if default_ok else 'WRONG'} values")
print(f"CollectiveGatherV2 lowering, devices (0, 1, 2, 3): {'right' if ascending_ok else 'WRONG'} values")
print(f"CollectiveGatherV2 lowering, devices (2, 3, 0, 1): {'right' if falling_ok else 'WRONG values, no error'}")
sys.exit(1 if default_ok and ascending_ok and not falling_ok else 0)
