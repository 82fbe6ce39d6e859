"""HSDP needs a batch dim sharded over two mesh dims; a TF DTensor Layout cannot say that.

    python docs/tf_dtensor_repros/hsdp_batch_two_mesh_dims.py

HSDP on a (replicate, shard) mesh splits the batch over both mesh dims and
each parameter over "shard" only.  Keras layers take activations as plain
TF DTensors, whose Layout names at most one mesh dim per tensor dim: both
spellings of "dim 0 over r and s" are rejected.  (tfdist's own DTensor
encodes (Shard(0), Shard(0)) as an extra physical dim, which a Keras layer
cannot take.)  So ``fully_shard`` refuses a 2-D mesh.  Exit status 1 when the
limitation reproduces.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
from tensorflow.experimental import dtensor  # noqa: E402

mesh = dtensor.create_mesh([("r", 2), ("s", 4)], device_type="CPU")
refused = 0
for spec in (["r,s", dtensor.UNSHARDED], [("r", "s"), dtensor.UNSHARDED]):
    try:
        dtensor.Layout(spec, mesh)
        print(f"{spec!r}: accepted")
    except (ValueError, TypeError) as error:
        refused += 1
        print(f"{spec!r}: refused ({type(error).__name__}: {str(error).splitlines()[0][:100]})")
sys.exit(1 if refused == 2 else 0)
