"""HSDP needs a batch dim sharded over two mesh dims; a TF DTensor Layout cannot say that.

    python docs/tf_dtensor_repros/hsdp_batch_two_mesh_dims.py

HSDP on a (replicate, shard) mesh splits the batch over both mesh dims and
each parameter over "shard" only.  Keras layers take activations as plain
TF DTensors, whose Layout names at most one mesh dim per tensor dim: both
spellings of "dim 0 over r and s" are rejected.  (tfdist's own DTensor
encodes (Shard(0), Shard(0)) as an extra physical dim, which a Keras layer
cannot take.)

The route that carries per-device values elsewhere in tfdist (DDP's
replicas, FSDP's per-shard layers: a program vectorised over a stacked
leading axis sharded on a mesh dim, ``tfdist/tensor/_per_device.py``) does
not reach HSDP either.  Run per replicate group -- ``tf.vectorized_map`` over
``[R(r), B/R (s), ...]`` -- the group's FSDP-over-"s" layers relayout their
per-group tensors (the batch rows onto "s", the output back), and TF's
vectoriser has no converter for DTensor's ``Relayout`` op, so the program
cannot be built (part 2 below).  Gathering every parameter before the
vectorised program instead would move torch's bytes but hold every full
parameter on every device at once: DDP's memory, not FSDP's.  So
``fully_shard`` refuses a 2-D mesh.  Exit status 1 when both reproduce.
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

# part 2: one FSDP-over-"s" layer, run per replicate group by the vectoriser
U = dtensor.UNSHARDED
x = dtensor.relayout(dtensor.copy_to_mesh(tf.ones([2, 8, 16]), dtensor.Layout.replicated(mesh, 3)),
                     dtensor.Layout(["r", "s", U], mesh))
w = dtensor.relayout(dtensor.copy_to_mesh(tf.ones([16, 4]), dtensor.Layout.replicated(mesh, 2)),
                     dtensor.Layout(["s", U], mesh))


@tf.function
def per_group(x, w):
    def one_group(rows):  # what an FSDP layer does with its group's rows: batch on "s", weight gathered
        rows = dtensor.relayout(rows, dtensor.Layout(["s", U], mesh))
        return tf.matmul(rows, dtensor.relayout(w, dtensor.Layout([U, U], mesh)))

    return tf.vectorized_map(one_group, x, fallback_to_while_loop=False)


try:
    per_group(x, w)
    print("per-group program: built")
except ValueError as error:
    refused += 1
    print("per-group program: refused (no vectoriser converter for Relayout: "
          f"{'Relayout' in str(error)})")
sys.exit(1 if refused == 3 else 0)
