"""Tensor parallelism on Keras models: parity with one device, comm pattern, errors."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import DenseAdam, logits_loss_grads, max_weight_diff, no_global_distribution  # noqa: F401
from tfdist.keras._data import gather_to_numpy, shard_batch
from tfdist.models import GPT, MLP, mlp_tp_plan, parallelize_gpt
from tfdist.tensor import Replicate, Shard
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel,
    SequenceParallel, loss_parallel, parallelize_module,
)

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 16)).astype("float32")
Y = RNG.standard_normal((64, 16)).astype("float32")
V, S = 32, 8
IDS = RNG.integers(0, V, (32, S))
NEXT = RNG.integers(0, V, (32, S))


def mesh(shape):
    return tfdist.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))


def make_mlp(build=True):
    keras.utils.set_random_seed(0)
    model = MLP(16, 64)
    if build:
        model(X[:1])
    return model


def make_gpt(build=True, depth=2):
    keras.utils.set_random_seed(0)
    model = GPT(V, S, dim=16, heads=4, depth=depth)
    if build:
        model(IDS[:1])
    return model


def fit(model, x, y, loss, steps=20, batch=16, lr=1e-2):
    model.compile(optimizer=DenseAdam(lr), loss=loss)
    epochs = steps * batch // len(x)
    return model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False)


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1)], ids=str)
def test_mlp_tp_20_steps_equal_one_device(shape):
    ref = make_mlp()
    ref_hist = fit(ref, X, Y, "mse")
    keras.distribution.set_distribution(None)
    model = parallelize_module(make_mlp(), mesh(shape)["tp"], mlp_tp_plan())
    hist = fit(model, X, Y, "mse")
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-4)
    assert max_weight_diff(ref, model) < 1e-4


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_gpt_outputs_loss_and_gradients_equal_one_device(sequence_parallel):
    ref = make_gpt()
    r_logits, r_loss, r_grads = logits_loss_grads(ref, tf.constant(IDS[:8]), tf.constant(NEXT[:8]))
    m = mesh((2, 4))
    model = parallelize_gpt(make_gpt(), m, sequence_parallel=sequence_parallel)
    ids, labels = (shard_batch(tf.constant(a[:8]), m, 0) for a in (IDS, NEXT))
    logits, loss, grads = tf.function(lambda a, b: logits_loss_grads(model, a, b))(ids, labels)
    np.testing.assert_allclose(gather_to_numpy(logits), r_logits.numpy(), atol=2e-6)
    np.testing.assert_allclose(gather_to_numpy(loss), r_loss.numpy(), rtol=1e-6)
    for v, a, b in zip(ref.trainable_variables, r_grads, grads):
        np.testing.assert_allclose(
            gather_to_numpy(tf.convert_to_tensor(b)), tf.convert_to_tensor(a).numpy(), atol=2e-6, err_msg=v.path
        )


@pytest.mark.parametrize("build", [True, False], ids=["built", "unbuilt"])
def test_gpt_fit_equals_one_device(build):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = make_gpt()
    ref_hist = fit(ref, IDS, NEXT, loss, steps=20, batch=8)
    keras.distribution.set_distribution(None)
    model = parallelize_gpt(make_gpt(build=build), mesh((2, 4)))
    hist = fit(model, IDS, NEXT, loss, steps=20, batch=8)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-4)
    assert max_weight_diff(ref, model) < 5e-4
    from tfdist.keras._variables import layout_of

    block = model.blocks[0]
    assert layout_of(model.tok.embeddings._value).sharding_specs == ["tp", "unsharded"]
    assert layout_of(block.attn._query_dense.kernel._value).sharding_specs == ["unsharded", "tp", "unsharded"]
    assert layout_of(block.attn._output_dense.kernel._value).sharding_specs == ["tp", "unsharded", "unsharded"]
    assert layout_of(block.mlp.up.kernel._value).sharding_specs == ["unsharded", "tp"]
    assert layout_of(block.mlp.down.kernel._value).sharding_specs == ["tp", "unsharded"]
    assert layout_of(block.ln1.gamma._value).is_fully_replicated()
    np.testing.assert_allclose(model.predict(IDS, batch_size=8, verbose=0), ref.predict(IDS, verbose=0), atol=1e-3)


def test_loss_parallel_in_fit_with_ignore_class():
    labels = NEXT.copy()
    labels[0, :3] = 0
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    ref = make_gpt(depth=1)
    ref_hist = fit(ref, IDS, labels, loss, steps=8, batch=8)
    keras.distribution.set_distribution(None)
    model = parallelize_gpt(make_gpt(depth=1), mesh((2, 4)), loss_parallel=True)
    with loss_parallel():
        hist = fit(model, IDS, labels, loss, steps=8, batch=8)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    assert max_weight_diff(ref, model) < 5e-4


def test_loss_parallel_functions_on_class_sharded_logits():
    from tfdist.tensor import distribute_tensor

    m = mesh((2, 4))
    logits_np = RNG.standard_normal((8, 16)).astype("float32")
    labels_np = RNG.integers(0, 16, 8)
    logits = distribute_tensor(logits_np, m, [Shard(0), Shard(1)])
    labels = distribute_tensor(labels_np, m, [Shard(0), Replicate()])
    shifted = logits_np - logits_np.max(1, keepdims=True)
    want = -(shifted[np.arange(8), labels_np] - np.log(np.exp(shifted).sum(1)))
    with loss_parallel():
        got_keras = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        got_tf = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    np.testing.assert_allclose(gather_to_numpy(got_keras), want, rtol=1e-5)
    np.testing.assert_allclose(gather_to_numpy(got_tf), want, rtol=1e-5)


def test_megatron_collective_pattern():
    m = mesh((1, 8))
    model = parallelize_module(make_mlp(), m["tp"], mlp_tp_plan())
    x = shard_batch(tf.constant(X[:16]), m, 0)
    forward = tf.function(lambda a: model(a))
    forward(x)
    with CommDebugMode() as comm:
        forward(x)
    assert comm.get_comm_counts() == {"all_reduce": 1}  # one per Colwise/Rowwise pair

    def input_grad(a):
        with tf.GradientTape() as tape:
            tape.watch(a)
            out = model(a)
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, a)

    backward = tf.function(input_grad)
    backward(x)
    with CommDebugMode() as comm:
        backward(x)
    assert comm.get_comm_counts() == {"all_reduce": 2}  # + one in the backward


def test_embedding_colwise_and_rowwise_equal_replicated():
    class Emb(keras.Model):
        def __init__(self):
            super().__init__()
            self.col = keras.layers.Embedding(V, 16)
            self.row = keras.layers.Embedding(V, 16)

        def call(self, ids):
            return self.col(ids) + self.row(ids)

    keras.utils.set_random_seed(0)
    ref = Emb()
    ref(IDS[:1])
    want = ref(IDS[:8]).numpy()
    keras.utils.set_random_seed(0)
    model = Emb()
    model(IDS[:1])
    m = mesh((2, 4))
    parallelize_module(model, m["tp"], {"col": ColwiseParallel(output_layouts=Replicate()), "row": RowwiseParallel()})
    got = tf.function(lambda a: model(a))(shard_batch(tf.constant(IDS[:8]), m, 0))
    np.testing.assert_allclose(gather_to_numpy(got), want, atol=1e-6)
    np.testing.assert_allclose(gather_to_numpy(model(IDS[:8])), want, atol=1e-6)  # eager
    bad = IDS[:8].copy()
    bad[1, 2] = V  # no device owns this row: an error, as TF's gather on CPU, not silent zeros
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"id {V} is not in"):
        model.row(bad)
    # traced (as in fit), an error would poison TF's collective executor: that row is NaN instead
    rows = gather_to_numpy(tf.function(lambda a: model.row(a))(shard_batch(tf.constant(bad), m, 0)))
    assert np.isnan(rows[1, 2]).all()
    mask = np.ones(bad.shape, bool)
    mask[1, 2] = False
    np.testing.assert_allclose(rows[mask], ref.row(IDS[:8]).numpy()[mask], atol=1e-6)
    bad[3, 0] = -1  # Keras' take counts a negative id from the end, once: the last row
    bad[4, 1] = -V - 1  # ... and this one is still below the range
    rows = gather_to_numpy(tf.function(lambda a: model.row(a))(shard_batch(tf.constant(bad), m, 0)))
    assert np.isnan(rows[1, 2]).all() and np.isnan(rows[4, 1]).all()
    np.testing.assert_allclose(rows[3, 0], ref.row.embeddings.numpy()[V - 1], atol=1e-6)
    assert np.isfinite(np.delete(rows.reshape(-1, 16), [1 * S + 2, 4 * S + 1], axis=0)).all()


def test_rowwise_embedding_gradient_is_the_scatter_of_its_output_gradient():
    """d(sum(w * lookup(ids)))/d table = scatter-add of w over the ids (numpy), each row on its
    own device: ids of every shard, repeated ids, and the first and last row of each shard."""
    keras.utils.set_random_seed(0)
    layer = keras.layers.Embedding(V, 16)
    layer.build((None, S))
    table = layer.embeddings.numpy()
    parallelize_module(layer, mesh((2, 4))["tp"], RowwiseParallel())
    ids = IDS[:8].copy()
    ids[0, :4] = [0, V // 4 - 1, V // 4, V - 1]
    ids[1, :3] = 5  # repeated
    w = RNG.standard_normal((8, S, 16)).astype("float32")

    @tf.function
    def grads(a, weight):
        with tf.GradientTape() as tape:
            out = layer(a)
            loss = tf.reduce_sum(out * weight)
        return out, tape.gradient(loss, layer.embeddings.value)

    out, g = grads(shard_batch(tf.constant(ids), mesh((2, 4)), 0), shard_batch(tf.constant(w), mesh((2, 4)), 0))
    want = np.zeros_like(table)
    np.add.at(want, ids.reshape(-1), w.reshape(-1, 16))
    np.testing.assert_allclose(gather_to_numpy(out), table[ids], atol=1e-6)
    np.testing.assert_allclose(gather_to_numpy(g), want, atol=1e-5)
    # torch's bytes: the forward all-reduces the [4, S, 16] Partial rows over tp (4), the
    # backward sums each [V/4, 16] shard gradient over dp (2) only -- never the whole table
    with CommDebugMode() as comm:
        grads(shard_batch(tf.constant(ids), mesh((2, 4)), 0), shard_batch(tf.constant(w), mesh((2, 4)), 0))
    rows_bytes, shard_bytes = 4 * S * 16 * 4, V // 4 * 16 * 4
    assert comm.get_comm_counts() == {"all_reduce": 2}
    assert comm.get_comm_bytes()["all_reduce"] == 2 * 3 / 4 * rows_bytes + 2 * 1 / 2 * shard_bytes


def test_prepare_module_input_and_output():
    class Wrap(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(16)

        def call(self, x):
            return self.inner(x)

    keras.utils.set_random_seed(0)
    model = Wrap()
    model(X[:1])
    want = model(X[:8]).numpy()
    m = mesh((2, 4))
    parallelize_module(model, m["tp"], {
        "": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False),
        "inner": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
    })
    out = tf.function(lambda a: model(a))(shard_batch(tf.constant(X[:8]), m, 0))
    assert out.placements == (Shard(0), Shard(1))  # a tfdist DTensor: use_local_output=False
    np.testing.assert_allclose(out.numpy(), want, atol=1e-6)


def test_bad_plans_are_clear_errors():
    m = mesh((2, 4))
    with pytest.raises(ValueError, match=r"key 'blocks.\*.mlp.upp' matches no layer"):
        parallelize_module(make_gpt(), m["tp"], {"blocks.*.mlp.upp": ColwiseParallel()})
    with pytest.raises(TypeError, match="ColwiseParallel does not support layer 'ln_f'"):
        parallelize_module(make_gpt(), m["tp"], {"ln_f": ColwiseParallel()})
    with pytest.raises(TypeError, match="SequenceParallel does not support layer 'head'"):
        parallelize_module(make_gpt(), m["tp"], {"head": SequenceParallel()})
    with pytest.raises(ValueError, match="needs a 1-D mesh"):
        parallelize_module(make_mlp(), m, mlp_tp_plan())
    with pytest.raises(ValueError, match="is not divisible by mesh dim .tp."):
        odd = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="odd")])
        parallelize_module(odd, m["tp"], {"odd": ColwiseParallel()})
    lora = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="down")])
    lora.get_layer("down").enable_lora(2)
    with pytest.raises(ValueError, match="lora_enabled=True"):
        parallelize_module(lora, m["tp"], {"down": RowwiseParallel(output_layouts=Shard(0))})
    with pytest.raises(ValueError, match="matches plan keys"):
        parallelize_module(make_mlp(), m["tp"], {"up": ColwiseParallel(), "u*": ColwiseParallel()})
    # a failed call leaves nothing behind: no distribution, no variable moved
    assert keras.distribution.distribution() is None
    model = make_mlp()
    with pytest.raises(TypeError):
        parallelize_module(model, m["tp"], {"up": ColwiseParallel(), "down": SequenceParallel()})
    assert keras.distribution.distribution() is None
    assert not any(isinstance(v._value, tf.experimental.dtensor.DVariable) for v in model.variables)
