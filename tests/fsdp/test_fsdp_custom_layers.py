"""fully_shard on layers FSDP does not know (custom layers, keras-hub's own layers): each runs per
data-parallel shard, as torch's ranks run a module, so its weight gradients are reduce-scattered
(torch's bytes) instead of all-reduced by TF; a layer that cannot run that way keeps the gathered
route and still computes one device's values."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import DenseAdam, float64, no_global_distribution, sum_sq_grads, traced_sum_sq_grads  # noqa: F401
from tfdist.fsdp import fully_shard
from tfdist.keras._data import gather_to_numpy
from tfdist.tensor.debug import CommDebugMode

RNG = np.random.default_rng(0)
X = tf.constant(RNG.standard_normal((16, 64)), tf.float32)
N = 8


class Affine(keras.layers.Layer):
    """A user's own Dense: weights made with add_weight, its own call (with Keras' `training`)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], self.units), initializer="glorot_uniform", name="w")
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal", name="b")

    def call(self, x, training=None):
        return tf.tanh(tf.matmul(x, self.w) + self.b)


class ColumnMean(keras.layers.Layer):
    """Output not row-wise (a mean over the batch): cannot run per shard."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="glorot_uniform", name="w")

    def call(self, x):
        return tf.reduce_mean(tf.matmul(x, self.w), axis=0, keepdims=True)


class Centered(keras.layers.Layer):
    """Row-wise output that mixes rows (centred on the batch mean), as batch statistics do."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 8), initializer="glorot_uniform", name="w")

    def call(self, x):
        return tf.matmul(x - tf.reduce_mean(x, axis=0, keepdims=True), self.w)


def dp_mesh():
    return tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))


def affine_stack():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), Affine(64, name="a0"), Affine(64, name="a1"), keras.layers.Dense(8)])


def shard_each(model):
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh())
    return fully_shard(model, mesh=dp_mesh())


def test_custom_layer_gradients_are_reduce_scattered_with_torchs_bytes():
    """Every weight (the custom layers' and the Dense's) goes through one reduce-scatter that sends
    (N-1)/N of its bytes per device (torch's); no all-reduce (main: each custom weight all-reduced,
    2 (N-1)/N); gradients equal one device's, traced and eager."""
    ref = sum_sq_grads(affine_stack(), X)
    model = shard_each(affine_stack())
    grads, comm = traced_sum_sq_grads(model, X)
    counts = comm.get_comm_counts()
    assert "all_reduce" not in counts and counts["reduce_scatter_tensor"] == 6, counts
    param_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert comm.get_comm_bytes()["reduce_scatter_tensor"] == pytest.approx(param_bytes * (N - 1) / N, rel=1e-6)
    for a, b in zip(ref, grads):
        np.testing.assert_allclose(gather_to_numpy(b), a.numpy(), rtol=1e-5, atol=1e-5)
    for a, b in zip(ref, sum_sq_grads(model, X)):  # eager
        np.testing.assert_allclose(gather_to_numpy(b), a.numpy(), rtol=1e-5, atol=1e-5)


def test_custom_layers_fit_like_one_device(float64):
    x, y = RNG.standard_normal((64, 64)), RNG.standard_normal((64, 8))
    ref, model = affine_stack(), shard_each(affine_stack())
    losses = []
    for m in (ref, model):
        m.compile(optimizer=DenseAdam(1e-2), loss="mse")
        losses.append(m.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-10)
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-10)


def test_a_layer_that_is_not_row_wise_keeps_the_gathered_route():
    """Its output is a batch mean: it runs as one computation over the whole batch (TF sums its
    gradient with an all-reduce), and equals one device."""
    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((64,)), Affine(64, name="a0"), ColumnMean(name="mean")])

    ref = sum_sq_grads(make(), X)
    model = shard_each(make())
    grads, comm = traced_sum_sq_grads(model, X)
    assert comm.get_comm_counts().get("all_reduce", 0) >= 1
    for a, b in zip(ref, grads):
        np.testing.assert_allclose(gather_to_numpy(b), a.numpy(), rtol=1e-5, atol=1e-5)


def test_a_layer_mixing_rows_sees_its_shards_rows_as_under_torch():
    """torch's FSDP runs a module on each rank's rows; so does tfdist: the batch mean a layer takes
    is its shard's (numpy per shard of 16 / 8 = 2 rows)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), Centered(name="c")])
    w = model.layers[0].w.numpy()
    fully_shard(model, mesh=dp_mesh())
    got = gather_to_numpy(tf.function(model)(X))
    x = X.numpy().reshape(N, -1, 64)
    want = ((x - x.mean(axis=1, keepdims=True)) @ w).reshape(16, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is a test extra: pip install -e '.[test]'")
HUB = dict(vocabulary_size=64, num_layers=2, hidden_dim=32, intermediate_dim=64, num_query_heads=4,
           num_key_value_heads=2)


def _hub_lm(family):
    backbone, lm = {"llama": (keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM),
                    "gemma": (keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM)}[family]
    extra = dict(head_dim=8) if family == "gemma" else {}
    keras.utils.set_random_seed(0)
    return lm(backbone=backbone(**HUB, **extra), preprocessor=None)


def hub_batch():
    """16 rows of 8 token ids and their next tokens, keras-hub's causal-LM inputs."""
    ids = np.random.default_rng(0).integers(0, 64, (16, 8)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, axis=1)


def assert_hub_fit_equals_one_device(ref, lm, x, y):
    """3 fit steps of the one-device ``ref`` and the distributed ``lm`` (dense Adam): the same losses
    and weights."""
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for m in (ref, lm):
        m.compile(optimizer=DenseAdam(1e-2), loss=sce)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            losses.append(m.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for a, b in zip(ref.get_weights(), lm.get_weights()):
        np.testing.assert_allclose(b, a, atol=2e-5)


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma", marks=pytest.mark.slow)])
def test_keras_hub_blocks_under_fully_shard_train_like_one_device_with_reduce_scatters(family):
    """keras-hub's decoder blocks (their RMS norms are keras-hub's own layers; Llama keeps its parts in
    private attributes) under fully_shard: every weight is sharded and reduce-scattered except the
    token table's lookup gradient (an integer input: TF's all-reduce, documented); 3 fit steps
    equal one device."""
    x, y = hub_batch()
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = _hub_lm(family)
    lm = _hub_lm(family)
    for block in lm.backbone.transformer_layers:
        fully_shard(block, mesh=dp_mesh())
    fully_shard(lm, mesh=dp_mesh())
    assert sum(len(b.fsdp_params) for b in lm.backbone.transformer_layers) == 9 * 2

    @tf.function
    def step(xx, yy):
        with tf.GradientTape() as tape:
            loss = sce(yy, lm(xx))
        return tape.gradient(loss, lm.trainable_variables)

    with CommDebugMode() as comm:
        step({k: tf.constant(v) for k, v in x.items()}, tf.constant(y))
    counts = comm.get_comm_counts()
    assert counts.get("all_reduce") == 1, counts  # the token lookup's table gradient
    assert counts["reduce_scatter_tensor"] >= 2 * 9 + 1, counts
    assert_hub_fit_equals_one_device(ref, lm, x, y)


def test_keras_hub_llama_accumulates_unreduced_until_the_synchronizing_micro_batch():
    """Gradient accumulation on keras-hub's Llama under fully_shard: the held micro-batch
    reduce-scatters nothing, the synchronizing one reduce-scatters every sharded weight once, and
    its gradients are the sum of both micro-batches' one-device gradients."""
    rng = np.random.default_rng(1)
    micro = []
    for _ in range(2):
        ids = rng.integers(0, 64, (16, 8)).astype("int32")
        micro.append(({"token_ids": tf.constant(ids), "padding_mask": tf.ones_like(ids)},
                      tf.constant(np.roll(ids, -1, axis=1))))
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def grads_of(model, xx, yy):
        with tf.GradientTape() as tape:
            loss = sce(yy, model(xx))
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

    ref = _hub_lm("llama")
    want = [sum(gs).numpy() for gs in zip(*(grads_of(ref, xx, yy) for xx, yy in micro))]
    lm = _hub_lm("llama")
    for block in lm.backbone.transformer_layers:
        fully_shard(block, mesh=dp_mesh())
    fully_shard(lm, mesh=dp_mesh())

    @tf.function
    def step(xx, yy, sync):
        lm.set_requires_gradient_sync(sync)
        return grads_of(lm, xx, yy)

    with CommDebugMode() as held:
        step(*micro[0], False)
    with CommDebugMode() as synced:
        got = step(*micro[1], True)
    assert "reduce_scatter_tensor" not in held.get_comm_counts(), held.get_comm_counts()
    assert synced.get_comm_counts()["reduce_scatter_tensor"] >= 2 * 9 + 1, synced.get_comm_counts()
    for a, b in zip(want, got):
        np.testing.assert_allclose(gather_to_numpy(b), a, rtol=1e-4, atol=1e-5)


class Counted(keras.layers.Layer):
    """A trainable integer weight beside a float one (Keras allows it)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 8), initializer="glorot_uniform", name="w")
        self.offset = self.add_weight(shape=(8,), initializer="ones", dtype="int32", name="offset")

    def call(self, x):
        return tf.matmul(x, self.w) + tf.cast(self.offset, x.dtype)


def test_a_non_float_parameter_stays_whole():
    """torch 2.12's FSDP2 keeps non-float parameters unsharded: so does tfdist (no gradient to
    reduce-scatter); the layer still computes one device's values."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), Counted(name="c")])
    want = model(X).numpy()
    fully_shard(model, mesh=dp_mesh())
    layer = model.layers[0]
    assert [v.name for v in model.fsdp_params] == ["w"]
    from tfdist.keras._variables import layout_of
    assert "dp" not in layout_of(layer.offset._value).sharding_specs
    np.testing.assert_allclose(gather_to_numpy(model(X)), want, rtol=1e-5, atol=1e-5)
