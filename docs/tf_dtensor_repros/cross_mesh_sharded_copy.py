"""TF DTensor (2.21) cannot copy a sharded DTensor to another mesh; a replicated one copies.

    python docs/tf_dtensor_repros/cross_mesh_sharded_copy.py

FSDP's CPU offload keeps each parameter shard on a host mesh and copies it to
the device mesh for each step (and the gradient shard back).
``dtensor.copy_to_mesh`` of a tensor sharded on one mesh to a sharded layout
on another mesh of the same shape fails in SPMD expansion ("SPMD expansion
resulted in op output inconsistent with the provided layout"); only a
replicated tensor crosses meshes.  So no program can move a shard between host
and device meshes without gathering it first, and tfdist copies each device's
shard between the step programs instead (tfdist/fsdp/_offload.py).  Exit status
1 when the limitation reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor  # noqa: E402

device_mesh = dtensor.create_mesh([("dp", 8)], device_type="CPU")
host_mesh = dtensor.create_mesh([("host", 8)], device_type="CPU", mesh_name="host")
U = dtensor.UNSHARDED
shard = dtensor.call_with_layout(tf.ones, dtensor.Layout(["dp", U], device_mesh), shape=(16, 4))
whole = dtensor.copy_to_mesh(dtensor.relayout(shard, dtensor.Layout([U, U], device_mesh)),
                             dtensor.Layout([U, U], host_mesh))
print("replicated copy to the host mesh:", dtensor.fetch_layout(whole).mesh.dim_names)
try:
    dtensor.copy_to_mesh(shard, dtensor.Layout(["host", U], host_mesh))
except Exception as error:  # noqa: BLE001 - TF raises InvalidArgumentError/InternalError by version
    print("sharded copy to the host mesh fails:", str(error).splitlines()[0][:160])
    sys.exit(1)
print("sharded copy worked: the limitation is gone")
