"""TF DTensor (2.21) computes an einsum wrongly, with no error, when one mesh dim shards a
different contracting label in each operand.

    python docs/tf_dtensor_repros/einsum_two_contracting_dims.py

``abcd,cde->abe`` (keras-hub's attention output projection: heads ``c``, head dim ``d``) with
``x`` laid out ``(dp, -, -, tp)`` and ``w`` ``(tp, -, -)``: each device multiplies its slice of
``d`` with its slice of ``c`` and the partial sums are added over ``tp`` as if both operands
were split along the same label.  Met in keras-hub's Llama with a layout map that stores the
value kernel ``("batch", None, "model")`` and the output kernel ``("model", "batch", None)``.
The same product with ``c`` and ``d`` merged into one dim first (a reshape) is right; tfdist
traces every einsum that contracts two or more contiguous labels that way
(``tfdist/tensor/_legalize.py``, ``_merged_contraction``).  Exit status 1 when the bug
reproduces.
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
x_np = rng.standard_normal((16, 8, 4, 8)).astype(np.float32)
w_np = rng.standard_normal((4, 8, 32)).astype(np.float32)


def put(a, specs):
    replicated = dtensor.copy_to_mesh(tf.constant(a), dtensor.Layout.replicated(mesh, a.ndim))
    return dtensor.relayout(replicated, dtensor.Layout(specs, mesh))


def gathered(y):
    """y on every device, one mesh dim gathered per relayout."""
    y = dtensor.relayout(y, dtensor.Layout([U] + dtensor.fetch_layout(y).sharding_specs[1:], mesh))
    return dtensor.unpack(dtensor.relayout(y, dtensor.Layout.replicated(mesh, y.shape.rank)))[0].numpy()


x, w = put(x_np, ["dp", U, U, "tp"]), put(w_np, ["tp", U, U])
expected = np.einsum("abcd,cde->abe", x_np, w_np)
direct = gathered(tf.function(lambda a, b: tf.einsum("abcd,cde->abe", a, b))(x, w))
merged = gathered(tf.function(lambda a, b: tf.einsum(
    "abk,ke->abe", tf.reshape(a, [16, 8, 32]), tf.reshape(b, [32, 32])))(x, w))
print(f"largest error: einsum {np.abs(direct - expected).max():.3g}, "
      f"contracting dims merged {np.abs(merged - expected).max():.3g}")
sys.exit(1 if not np.allclose(direct, expected, atol=1e-4) else 0)
