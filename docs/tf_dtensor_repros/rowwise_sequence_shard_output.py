"""TF DTensor (2.21) cannot relayout a contraction-sharded einsum to a sequence shard
under GradientTape in a tf.function.

    python docs/tf_dtensor_repros/rowwise_sequence_shard_output.py

Pattern: the output projection of head-sharded attention (Megatron
RowwiseParallel) with ``output_layouts=Shard(1)`` (sequence parallelism).
Relayouting to replicated works; relayouting to a sequence shard -- directly
or after a replicated relayout -- fails layout propagation here, and inside a
GPT block it silently gives wrong gradients (tests/test_keras_tp.py guards
tfdist's refusal).  Exit status 1 when the bug reproduces.
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
rng = np.random.default_rng(0)
x_np = rng.standard_normal((2, 8, 4, 3)).astype("float32")  # [batch, seq, heads, head_dim]
w_np = rng.standard_normal((4, 3, 5)).astype("float32")      # [heads, head_dim, model]


def put(a, spec):
    rep = dtensor.Layout.replicated(mesh, a.ndim)
    return dtensor.relayout(dtensor.copy_to_mesh(tf.constant(a), rep), dtensor.Layout(spec, mesh))


@tf.function
def grads(x, w, sequence_shard):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        a = tf.einsum("bshd,hde->bse", dtensor.relayout(x, dtensor.Layout(["dp", U, "tp", U], mesh)), w)
        a = dtensor.relayout(a, dtensor.Layout(["dp", "tp" if sequence_shard else U, U], mesh))
        # the input is also used directly, as a residual stream is
        loss = tf.reduce_sum(tf.sin(a) * tf.reduce_sum(x, axis=(2, 3))[..., None])
    return tape.gradient(loss, [x, w])


ok = True
for sequence_shard in (False, True):
    try:
        grads(put(x_np, ["dp", U, U, U]), put(w_np, ["tp", U, U]), sequence_shard)
        print(f"OK  relayout to {'Shard(1)' if sequence_shard else 'Replicate'}")
    except Exception as err:  # noqa: BLE001 - we print what TF raises
        ok = False
        print(f"BAD relayout to {'Shard(1)' if sequence_shard else 'Replicate'}: "
              f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
sys.exit(0 if ok else 1)
