"""HSDP needs a batch dim sharded over two mesh dims; a TF DTensor Layout cannot say that.

    python docs/tf_dtensor_repros/hsdp_batch_two_mesh_dims.py

HSDP on a (replicate, shard) mesh splits the batch over both mesh dims and
each parameter over "shard" only.  Keras layers take activations as plain
TF DTensors, whose Layout names at most one mesh dim per tensor dim: both
spellings of "dim 0 over r and s" are rejected.  (tfdist's own DTensor
encodes (Shard(0), Shard(0)) as an extra physical dim, which a Keras layer
cannot take.)

Run per replicate group -- ``tf.vectorized_map`` over ``[R(r), B/R (s), ...]``,
the route that carries per-device values elsewhere in tfdist
(``tfdist/tensor/_per_device.py``) -- the group's FSDP-over-"s" layers relayout
their per-group tensors, and TF's vectoriser has no converter for DTensor's
``Relayout`` op (part 2 below).  That is TF's default, not a wall: tfdist's HSDP
registers one while a group's program is vectorised
(``tfdist/fsdp/_replica_groups.py``, docs/design.md "HSDP").  Exit status 1 when
both refusals reproduce.
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
