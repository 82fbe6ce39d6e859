"""TF DTensor (2.21): a tf.function kept as a call (``_noinline``) inside a function on a mesh does
not compile, so no callee can be handed to XLA after DTensor's expansion.

    python docs/tf_dtensor_repros/noinline_callee_on_a_mesh.py

DTensor's pipeline inlines every callee it can before layout propagation
(``dtensor_mlir_passes.cc``), and TF's inliner takes a jit-compiled callee apart whatever its
attributes say (``TFInlinerInterface::isLegalToInline``: ``if (callable->hasAttr("tf._XlaMustCompile"))
return true;``). The one way to keep a call is ``_noinline``; then the callee's ops get no mesh and
the mesh clustering refuses the program ("failed to merge mesh cluster as cluster does not have mesh
attribute"), also with the mesh named on the call (``_mesh``) and with ``_XlaMustCompile`` on the call.
Prints one line per variant; exit status 1 when every kept call fails (the limit reproduces).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import attr_value_pb2  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
from tensorflow.experimental import dtensor  # noqa: E402

mesh = dtensor.create_mesh([("x", 4)], device_type="CPU")
x = dtensor.relayout(dtensor.copy_to_mesh(tf.ones([8, 16]), dtensor.Layout.replicated(mesh, 2)),
                     dtensor.Layout(["x", dtensor.UNSHARDED], mesh))
w = dtensor.copy_to_mesh(tf.ones([16, 16]), dtensor.Layout.replicated(mesh, 2))
inner = tf.function(lambda x, w: tf.tanh(x @ w), experimental_attributes={"_noinline": True})
VARIANTS = {
    "kept call": {},
    "kept call, _mesh on the call": {"_mesh": attr_value_pb2.AttrValue(s=mesh.to_string().encode())},
    "kept call, _mesh and _XlaMustCompile on the call": {
        "_mesh": attr_value_pb2.AttrValue(s=mesh.to_string().encode()),
        "_XlaMustCompile": attr_value_pb2.AttrValue(b=True)},
}
failed = 0
for name, attrs in VARIANTS.items():
    @tf.function
    def step(x, w):
        with tf.compat.v1.get_default_graph()._attr_scope(attrs):
            return inner(x, w)
    try:
        out = step(x, w)
        print(f"{name}: runs, sum {float(tf.reduce_sum(dtensor.unpack(out)[0])):.3f}")
    except (tf.errors.UnknownError, tf.errors.InvalidArgumentError) as e:
        failed += 1
        print(f"{name}: fails: " + next((ln.strip() for ln in str(e).splitlines() if "mesh" in ln), str(e)[:200]))
sys.exit(1 if failed == len(VARIANTS) else 0)
