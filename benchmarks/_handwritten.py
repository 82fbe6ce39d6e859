"""The benchmark baselines, written without tfdist: the models by hand in raw
``tf.experimental.dtensor``, and the GPT in tf_keras layers under a tf_keras layout map.
No tfdist code runs inside these programs.

Each builder takes the one-device Keras model (for its initial weights) and a TF mesh (or
``None`` for plain variables on one device) and returns ``(weights, forward)``: a dict of
variables with the Megatron layouts, and the forward pass on a batch.
"""

from __future__ import annotations

import math

import tensorflow as tf
from tensorflow.experimental import dtensor

U = dtensor.UNSHARDED


def _placer(tf_mesh):
    def dvar(value, *specs):
        value = tf.constant(value)
        if tf_mesh is None:
            return tf.Variable(value)
        rep = dtensor.Layout.replicated(tf_mesh, value.shape.rank)
        return dtensor.DVariable(dtensor.relayout(dtensor.copy_to_mesh(value, rep), dtensor.Layout(list(specs), tf_mesh)))

    def relayout(t, *specs):
        return t if tf_mesh is None else dtensor.relayout(t, dtensor.Layout(list(specs), tf_mesh))

    return dvar, relayout


def place_by_dp(batch, tf_mesh, shape=(2, 4)):
    """A host ``batch`` on a ``(dp, tp)`` mesh of ``shape``, batch-sharded on dp: split once into
    the dp pieces and packed by coordinate (the tp devices of a dp row share one piece)."""
    pieces = tf.split(tf.constant(batch), shape[0])
    layout = dtensor.Layout(["dp"] + [U] * (batch.ndim - 1), tf_mesh)
    return dtensor.pack([pieces[i // shape[1]] for i in range(shape[0] * shape[1])], layout)


def mlp(reference, tf_mesh):
    """``down(gelu(up(x)))``: up column-parallel, down row-parallel on the "tp" mesh dim."""
    dvar, _ = _placer(tf_mesh)
    up, down = reference.get_layer("up"), reference.get_layer("down")
    w = {"up": dvar(up.kernel.numpy(), U, "tp"), "upb": dvar(up.bias.numpy(), "tp"),
         "dn": dvar(down.kernel.numpy(), "tp", U), "dnb": dvar(down.bias.numpy(), U)}

    def forward(x):
        return tf.nn.gelu(x @ w["up"] + w["upb"], approximate=False) @ w["dn"] + w["dnb"]

    return w, forward


def gpt(reference, tf_mesh, vocab: int, seq: int, dim: int, heads: int):
    """``tfdist.models.GPT``'s forward with head-sharded attention, Megatron MLP, vocabulary-
    parallel embedding and head; the logits stay sharded on the vocabulary."""
    dvar, relayout = _placer(tf_mesh)
    w = {"tok": dvar(reference.tok.embeddings.numpy(), "tp", U),
         "pos": dvar(reference.pos.embeddings.numpy(), U, U),
         "lnf_g": dvar(reference.ln_f.gamma.numpy(), U), "lnf_b": dvar(reference.ln_f.beta.numpy(), U),
         "head": dvar(reference.head.kernel.numpy(), U, "tp")}
    for i, b in enumerate(reference.blocks):
        a = b.attn
        w.update({
            f"{i}ln1_g": dvar(b.ln1.gamma.numpy(), U), f"{i}ln1_b": dvar(b.ln1.beta.numpy(), U),
            f"{i}ln2_g": dvar(b.ln2.gamma.numpy(), U), f"{i}ln2_b": dvar(b.ln2.beta.numpy(), U),
            f"{i}q": dvar(a._query_dense.kernel.numpy(), U, "tp", U), f"{i}qb": dvar(a._query_dense.bias.numpy(), "tp", U),
            f"{i}k": dvar(a._key_dense.kernel.numpy(), U, "tp", U), f"{i}kb": dvar(a._key_dense.bias.numpy(), "tp", U),
            f"{i}v": dvar(a._value_dense.kernel.numpy(), U, "tp", U), f"{i}vb": dvar(a._value_dense.bias.numpy(), "tp", U),
            f"{i}o": dvar(a._output_dense.kernel.numpy(), "tp", U, U), f"{i}ob": dvar(a._output_dense.bias.numpy(), U),
            f"{i}up": dvar(b.mlp.up.kernel.numpy(), U, "tp"), f"{i}upb": dvar(b.mlp.up.bias.numpy(), "tp"),
            f"{i}dn": dvar(b.mlp.down.kernel.numpy(), "tp", U), f"{i}dnb": dvar(b.mlp.down.bias.numpy(), U),
        })
    depth = len(reference.blocks)

    def ln(h, g, b):
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + 1e-5) * g + b

    def forward(ids):
        one_hot = relayout(tf.one_hot(ids, vocab), "dp", U, "tp")
        h = tf.einsum("bsv,vd->bsd", one_hot, w["tok"]) + w["pos"][:seq]
        mask = tf.linalg.band_part(tf.ones((seq, seq)), -1, 0)
        for i in range(depth):
            a = ln(h, w[f"{i}ln1_g"], w[f"{i}ln1_b"])
            q = tf.einsum("abc,cde->abde", a, w[f"{i}q"]) + w[f"{i}qb"]
            k = tf.einsum("abc,cde->abde", a, w[f"{i}k"]) + w[f"{i}kb"]
            v = tf.einsum("abc,cde->abde", a, w[f"{i}v"]) + w[f"{i}vb"]
            q = q * (1.0 / math.sqrt(dim // heads))
            scores = tf.einsum("aecd,abcd->acbe", k, q)
            scores = scores + (1.0 - mask) * -1e9
            att = tf.einsum("acbe,aecd->abcd", tf.nn.softmax(scores, axis=-1), v)
            h = h + tf.einsum("abcd,cde->abe", att, w[f"{i}o"]) + w[f"{i}ob"]
            m = ln(h, w[f"{i}ln2_g"], w[f"{i}ln2_b"])
            up = tf.nn.gelu(tf.einsum("bsd,dh->bsh", m, w[f"{i}up"]) + w[f"{i}upb"], approximate=False)
            h = h + tf.einsum("bsh,hd->bsd", up, w[f"{i}dn"]) + w[f"{i}dnb"]
        return tf.einsum("bsd,dv->bsv", ln(h, w["lnf_g"], w["lnf_b"]), w["head"])

    return w, forward


def sharded_cross_entropy(labels, logits):
    """Mean token cross-entropy on vocabulary-sharded logits, as one writes it by hand for TF
    DTensor: every class-dim reduction is a reduction of a sharded dim (an all-reduce of a
    ``[batch, seq]`` tensor), never a gather of the logits."""
    peak = tf.stop_gradient(tf.reduce_max(logits, axis=-1, keepdims=True))
    lse = tf.math.log(tf.reduce_sum(tf.exp(logits - peak), axis=-1)) + tf.squeeze(peak, -1)
    picked = tf.reduce_sum(tf.one_hot(labels, logits.shape[-1]) * logits, axis=-1)
    return tf.reduce_mean(lse - picked)


def adam(weights: dict, lr: float, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7):
    """Keras' Adam written by hand on the same variables: slots take their weight's layout, and the
    update uses the values it computed (a DVariable read right after its own assign on a 2-D mesh
    returns the old value in TF 2.21)."""
    def like(v):
        zeros = tf.zeros_like(v)
        return tf.Variable(zeros) if not dtensor.is_dtensor(zeros) else dtensor.DVariable(zeros)

    slots = {n: (like(v), like(v)) for n, v in weights.items()}
    step = tf.Variable(0.0)
    if dtensor.is_dtensor(next(iter(weights.values()))):
        mesh = dtensor.fetch_layout(next(iter(weights.values()))).mesh
        step = dtensor.DVariable(dtensor.copy_to_mesh(tf.constant(0.0), dtensor.Layout.replicated(mesh, 0)))

    def apply(grads: dict) -> None:
        t = step + 1.0
        step.assign(t)
        alpha = lr * tf.sqrt(1.0 - tf.pow(beta_2, t)) / (1.0 - tf.pow(beta_1, t))
        for n, g in grads.items():
            g = tf.convert_to_tensor(g)
            m, v = slots[n]
            m_new = m + (g - m) * (1.0 - beta_1)
            v_new = v + (tf.square(g) - v) * (1.0 - beta_2)
            m.assign(m_new)
            v.assign(v_new)
            weights[n].assign_sub(m_new * alpha / (tf.sqrt(v_new) + epsilon))

    return apply


def train_step(reference, tf_mesh, w: dict):
    """One training step of workload ``w`` (``compare.WORKLOADS``) by hand, as a ``tf.function``
    ``step(x, y) -> loss``: the forward above, its loss (MSE, or cross-entropy on the
    vocabulary-sharded logits) and Adam by hand."""
    if w["kind"] == "mlp":
        weights, forward = mlp(reference, tf_mesh)
        loss_of = lambda out, target: tf.reduce_mean(tf.square(out - target))  # noqa: E731
    else:
        weights, forward = gpt(reference, tf_mesh, w["vocab"], w["seq"], w["dim"], w["heads"])
        loss_of = lambda out, target: sharded_cross_entropy(target, out)  # noqa: E731
    update = adam(weights, w["lr"])
    names = sorted(weights)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_of(forward(xb), yb)
        update(dict(zip(names, tape.gradient(loss, [weights[n] for n in names]))))
        return loss

    return step


def tf_keras_gpt(mesh, axis: str, vocab: int, seq: int, dim: int, heads: int, depth: int):
    """The GPT in tf_keras (Keras 2) layers under a tf_keras DTensor ``LayoutMap`` sharding
    ``axis`` as in the plan: the other baseline (its own initial weights)."""
    import tf_keras
    from tf_keras.dtensor import experimental as kdt

    layout_map = kdt.LayoutMap(mesh=mesh)
    layout_map[".*embeddings"] = dtensor.Layout([axis, U], mesh)
    for proj in ("query", "key", "value"):
        layout_map[f".*{proj}/kernel"] = dtensor.Layout([U, axis, U], mesh)
    layout_map[".*attention_output/kernel"] = dtensor.Layout([axis, U, U], mesh)
    layout_map[".*mlp_up.*/kernel"] = dtensor.Layout([U, axis], mesh)
    layout_map[".*mlp_down.*/kernel"] = dtensor.Layout([axis, U], mesh)
    layout_map[".*lm_head/kernel"] = dtensor.Layout([U, axis], mesh)
    with layout_map.scope():
        inputs = tf_keras.Input((seq,), dtype="int32")
        h = tf_keras.layers.Embedding(vocab, dim)(inputs)
        for i in range(depth):
            a = tf_keras.layers.LayerNormalization(epsilon=1e-5)(h)
            h = h + tf_keras.layers.MultiHeadAttention(heads, dim // heads)(a, a, use_causal_mask=True)
            m = tf_keras.layers.LayerNormalization(epsilon=1e-5)(h)
            up = tf_keras.layers.Dense(4 * dim, activation="gelu", name=f"mlp_up_{i}")(m)
            h = h + tf_keras.layers.Dense(dim, name=f"mlp_down_{i}")(up)
        logits = tf_keras.layers.Dense(vocab, use_bias=False, name="lm_head")(
            tf_keras.layers.LayerNormalization(epsilon=1e-5)(h))
        return tf_keras.Model(inputs, logits)
