"""tfdist.models.split_gpt: a GPT cut into pipeline stages that share its variables and names, and those
stages trained 3-D in one process (pp over two sub-meshes x FSDP x TP inside each) against the whole GPT
on one device (float64)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_helpers import float64, no_global_distribution  # noqa: F401
from tfdist.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tfdist.device_mesh import DeviceMesh
from tfdist.fsdp import fully_shard
from tfdist.models import GPT, parallelize_gpt, split_gpt
from tfdist.pipelining import PipelineStage, Schedule1F1B

VOCAB, SEQ = 32, 8
RNG = np.random.default_rng(0)
X = RNG.integers(0, VOCAB, (8, SEQ)).astype("int32")
Y = RNG.integers(0, VOCAB, (8, SEQ)).astype("int32")


def gpt(depth=4):
    keras.utils.set_random_seed(0)
    with tf.device("CPU:0"):
        model = GPT(VOCAB, SEQ, 16, 2, depth)
        model(X[:1])
    return model


def cross_entropy(logits, target):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, logits, from_logits=True))


def test_stages_chain_to_the_model_and_keep_its_names(float64):
    model = gpt(depth=5)
    stages = split_gpt(model, 3)
    assert [list(s.blocks) for s in stages] == [["0", "1"], ["2", "3"], ["4"]]
    h = X
    for stage in stages:
        h = stage(h)
    np.testing.assert_allclose(h, model(X), rtol=1e-12)
    whole = get_model_state_dict(model)
    parts = [get_model_state_dict(s) for s in stages]
    assert sorted(k for p in parts for k in p) == sorted(whole)  # a partition of the model's names
    assert "tok.embeddings" in parts[0] and "head.kernel" in parts[2] and "blocks.2.mlp.up.kernel" in parts[1]


def test_bad_arguments():
    with pytest.raises(TypeError, match="split_gpt needs a tfdist.models.GPT. Received: model of type Dense"):
        split_gpt(keras.layers.Dense(2), 2)
    with pytest.raises(ValueError, match="needs a built GPT"):
        split_gpt(GPT(VOCAB, SEQ, 16, 2, 2), 2)
    with pytest.raises(ValueError, match=r"num_stages must be an int from 1 to the GPT's depth \(2\).*num_stages=3"):
        split_gpt(gpt(depth=2), 3)


def test_gpt_stages_3d_in_one_process_give_the_one_device_gradients(float64):
    """Two stages, each on a (dp, tp) = 2 x 2 sub-mesh with the GPT plan over tp and FSDP over dp; one
    1F1B step's loss and every weight's gradient (seen through an SGD step of rate 1) equal the whole
    GPT's on one device."""
    ref = gpt()
    with tf.device("CPU:0"), tf.GradientTape() as tape:
        ref_loss = cross_entropy(ref(X), Y)
    names = list(get_model_state_dict(ref))
    grads = tape.gradient(ref_loss, ref.trainable_variables)
    want = {n: v.numpy() - tf.convert_to_tensor(g).numpy() for n, v, g in zip(names, ref.trainable_variables, grads)}
    subs = [DeviceMesh("cpu", [[4 * g, 4 * g + 1], [4 * g + 2, 4 * g + 3]], mesh_dim_names=("dp", "tp"))
            for g in range(2)]
    stages = []
    for i, part in enumerate(split_gpt(gpt(), 2)):
        parallelize_gpt(part, subs[i], loss_parallel=False)
        fully_shard(part, mesh=subs[i]["dp"])
        stages.append(PipelineStage(part, i, 2, subs[i]))
    losses = []
    Schedule1F1B(stages, n_microbatches=4, loss_fn=cross_entropy).step(X, target=Y, losses=losses)
    np.testing.assert_allclose(np.mean([tf.reduce_mean(l) for l in losses]), ref_loss, rtol=1e-10)
    for st in stages:
        keras.optimizers.SGD(1.0).apply(st.grads, st.submod.trainable_variables)
        full = get_model_state_dict(st.submod, options=StateDictOptions(full_state_dict=True))
        for name, value in full.items():
            np.testing.assert_allclose(np.asarray(value), want[name], rtol=1e-10, atol=1e-13, err_msg=name)
