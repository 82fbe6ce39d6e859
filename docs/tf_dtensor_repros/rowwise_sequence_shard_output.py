"""TF DTensor (2.21) mis-propagates the gradient layout of a relayout whose input also feeds
a residual, under GradientTape in a tf.function -- and the workaround tfdist uses.

    python docs/tf_dtensor_repros/rowwise_sequence_shard_output.py

Pattern: the output projection of head-sharded attention (Megatron
RowwiseParallel) with ``output_layouts=Shard(1)`` (sequence parallelism); its
input is relayouted to the head shard and also used directly, as a residual
stream is.  TF's gradient of ``relayout`` is ``RelayoutLike``, which leaves the
layout to propagation; here propagation fails ("output layout of Relayout op
after layout propagation does not match"), and inside a GPT block it gave
silently wrong gradients.

Workaround (tfdist.tensor.parallel.style._relayout_with_gradient): a relayout
whose custom gradient relayouts the incoming gradient to the layout the input
is declared to arrive in (torch's backward of a redistribute).  Printed lines:
``TF  ...`` for TF's own relayout, ``tfdist ...`` for the workaround, each
``OK`` when the gradients equal numpy's single-device gradients.  Exit status
1 while the TF bug reproduces and the workaround holds; 2 if the workaround
breaks.
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
x_np = rng.standard_normal((2, 8, 4, 3))  # [batch, seq, heads, head_dim]
w_np = rng.standard_normal((4, 3, 5))      # [heads, head_dim, model]
ARRIVES = dtensor.Layout(["dp", U, U, U], mesh)
HEADS = dtensor.Layout(["dp", U, "tp", U], mesh)
SEQUENCE = dtensor.Layout(["dp", "tp", U], mesh)


def put(a, spec):
    rep = dtensor.Layout.replicated(mesh, a.ndim)
    return dtensor.relayout(dtensor.copy_to_mesh(tf.constant(a), rep), dtensor.Layout(spec, mesh))


def relayout_declared(x, layout, grad_layout):
    """The workaround: the gradient goes to the declared input layout, not to propagation."""

    @tf.custom_gradient
    def move(x):
        return dtensor.relayout(x, layout), lambda dy: dtensor.relayout(dtensor.relayout(dy, layout), grad_layout)

    return move(x)


def gather(t):
    for d in range(t.shape.rank):  # one mesh dim at a time (see all_gather_two_mesh_dims.py)
        specs = list(dtensor.fetch_layout(t).sharding_specs)
        specs[d] = U
        t = dtensor.relayout(t, dtensor.Layout(specs, mesh))
    return dtensor.unpack(t)[0].numpy()


def run(to_heads):
    @tf.function
    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            a = tf.einsum("bshd,hde->bse", to_heads(x), w)
            a = dtensor.relayout(a, SEQUENCE)
            loss = tf.reduce_sum(tf.sin(a) * tf.reduce_sum(x, axis=(2, 3))[..., None])
        return tape.gradient(loss, [x, w])

    return [gather(g) for g in grads(put(x_np, ["dp", U, U, U]), put(w_np, ["tp", U, U]))]


def reference():
    x, w = tf.constant(x_np), tf.constant(w_np)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        loss = tf.reduce_sum(tf.sin(tf.einsum("bshd,hde->bse", x, w)) * tf.reduce_sum(x, axis=(2, 3))[..., None])
    return [g.numpy() for g in tape.gradient(loss, [x, w])]


def check(name, to_heads):
    try:
        got = run(to_heads)
    except Exception as err:  # noqa: BLE001 - we print what TF raises
        print(f"{name} BAD: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return False
    ok = all(np.allclose(g, r, atol=1e-9) for g, r in zip(got, reference()))
    print(f"{name} {'OK' if ok else 'BAD: wrong gradients'}")
    return ok


tf_ok = check("TF     relayout to Shard(1):", lambda x: dtensor.relayout(x, HEADS))
ours_ok = check("tfdist relayout to Shard(1):", lambda x: relayout_declared(x, HEADS, ARRIVES))
sys.exit(0 if tf_ok and ours_ok else (1 if ours_ok else 2))
