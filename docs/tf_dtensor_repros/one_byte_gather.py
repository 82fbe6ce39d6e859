"""TF DTensor (2.21) all-gathers 1-byte types with an all-reduce of a widened buffer.

    python docs/tf_dtensor_repros/one_byte_gather.py

With ``LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2`` set, a Shard -> Replicate
relayout lowers to ``CollectiveGatherV2`` only for int32/int64/f16/f32/f64
(tensorflow/dtensor/mlir/collectives.cc). An int8 gather instead runs a
``CollectiveReduceV2`` over a zero-padded buffer of a wider type; this script
prints the collective nodes of the per-device program TF executed. The
obvious fix, carrying byte pairs as int16 with a size-changing ``tf.bitcast``,
fails in TF DTensor's layout propagation ("Rank for output 0 layout is 3
but actual rank is 2"), so tfdist packs the pairs arithmetically
(tfdist/tensor/_redistribute/_byte_gather.py, ``_gather_byte_pairs``).

Exit status 1 when both behaviours reproduce.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"] = "1"

import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
mesh = dtensor.create_mesh([("x", 4)], devices=[f"CPU:{i}" for i in range(4)])
sharded = dtensor.Layout(["x", dtensor.UNSHARDED], mesh)


def collectives_in(name, found):
    """(op, dtype, output shape) of each collective in function ``name`` and the ones it calls."""
    for node in context.context().get_function_def(name).node_def:
        if node.op.startswith("Collective"):
            shape = [d.size for d in node.attr["_output_shapes"].list.shape[0].dim]
            found.append((node.op, tf.dtypes.as_dtype(node.attr["T"].type).name, shape))
        if "f" in node.attr and node.attr["f"].func.name:
            collectives_in(node.attr["f"].func.name, found)
    return found


@tf.function
def gather(t):
    return dtensor.relayout(t, dtensor.Layout.replicated(mesh, 2))


x = dtensor.relayout(dtensor.copy_to_mesh(tf.zeros([16, 4], tf.int8), dtensor.Layout.replicated(mesh, 2)), sharded)
gather(x)
ran = []
for name in context.context().list_function_names():  # the SPMD-expanded program is <traced>__func_<hash>
    if name.startswith("__inference_gather") and "__func_" in name:
        collectives_in(name, ran)
print("an int8 gather of 64 bytes runs:", ran)
widened = [op for op, dtype, _ in ran if op == "CollectiveReduceV2" and dtype != "int8"]

try:
    tf.bitcast(tf.reshape(x, [16, 2, 2]), tf.int16)
    bitcast_fails = False
    print("size-changing bitcast: works")
except tf.errors.OpError as err:
    bitcast_fails = True
    print("size-changing bitcast fails:", str(err).splitlines()[0][:160])

raise SystemExit(1 if widened and bitcast_fails else 0)
