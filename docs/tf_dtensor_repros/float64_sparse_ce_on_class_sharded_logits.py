"""TF DTensor (2.21): sparse softmax cross-entropy on float64 logits sharded on the class dim
returns -0 for every row, eagerly and in a tf.function; float32 is right.

    python docs/tf_dtensor_repros/float64_sparse_ce_on_class_sharded_logits.py [float64|float32]

tfdist's ``loss_parallel()`` computes the loss without TF's kernel (logsumexp minus the target
logit), and Keras ``fit``/``evaluate`` on tfdist run their steps inside it.
"""
import sys, numpy as np, tensorflow as tf
from tensorflow.experimental import dtensor
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
mesh = dtensor.create_mesh([("x", 4)], devices=[f"CPU:{i}" for i in range(4)])
dt = sys.argv[1] if len(sys.argv) > 1 else "float64"
rng = np.random.default_rng(0)
logits = rng.standard_normal((8, 16)).astype(dt)
labels = rng.integers(0, 16, 8).astype(np.int32)
def loss(lab, lgt):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=lab, logits=lgt)
want = loss(labels, logits).numpy()
sharded = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(logits), dtensor.Layout.replicated(mesh, 2)), dtensor.Layout([dtensor.UNSHARDED, "x"], mesh))
lab = dtensor.copy_to_mesh(tf.constant(labels), dtensor.Layout.replicated(mesh, 1))
for name, f in (("eager", loss), ("tf.function", tf.function(loss))):
    got = f(lab, sharded)
    got = dtensor.unpack(dtensor.relayout(got, dtensor.Layout.replicated(mesh, 1)))[0].numpy()
    print(dt, name, "max |error|", np.abs(got - want).max(), "first", want[:2], got[:2])
