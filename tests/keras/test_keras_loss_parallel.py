"""loss_parallel() on class-sharded logits: every Keras cross-entropy configuration.

Reference: the same loss on unsharded float64 logits (Keras itself), values
and gradients to 1e-9; and the logits are never gathered (no all-gather).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import float64, no_global_distribution  # noqa: F401
from tfdist.keras._data import gather_to_numpy
from tfdist.tensor import Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.parallel import loss_parallel

RNG = np.random.default_rng(8)
B, S, C = 4, 6, 16
LOGITS = RNG.standard_normal((B, S, C)) * 3
LABELS = RNG.integers(0, C, (B, S))
LABELS[0, :2] = 3  # the ignored class appears
ONE_HOT = np.eye(C)[LABELS]
SOFT = RNG.dirichlet(np.ones(C), (B, S))  # dense labels that are not one-hot
WEIGHTS = RNG.uniform(0.5, 2.0, (B, S))

SPARSE = [
    dict(from_logits=True),
    dict(from_logits=True, ignore_class=3),
]
DENSE = [
    dict(from_logits=True),
    dict(from_logits=True, label_smoothing=0.1),
]
REDUCTIONS = [None, "sum", "sum_over_batch_size", "mean"]


pytestmark = pytest.mark.usefixtures("float64")  # Keras losses compute in floatx


def sharded_logits():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    return mesh, distribute_tensor(tf.constant(LOGITS), mesh, [Shard(0), Shard(2)]).to_tf()


def value_and_grad(loss_fn, labels, logits, weights):
    with tf.GradientTape() as tape:
        tape.watch(logits)
        value = loss_fn(labels, logits, sample_weight=weights)
    return value, tape.gradient(value, logits)


def check(loss_fn, labels, weights=None):
    want, want_grad = value_and_grad(loss_fn, tf.constant(labels), tf.constant(LOGITS), weights)
    mesh, logits = sharded_logits()
    labels_d = distribute_tensor(tf.constant(labels), mesh, [Shard(0)] + [Replicate()]).to_tf()
    weights_d = None if weights is None else distribute_tensor(tf.constant(weights), mesh, [Shard(0), Replicate()]).to_tf()
    step = tf.function(lambda a, b, w: value_and_grad(loss_fn, a, b, w))
    with loss_parallel():
        step(labels_d, logits, weights_d)
        with CommDebugMode() as comm:
            got, got_grad = step(labels_d, logits, weights_d)
    np.testing.assert_allclose(gather_to_numpy(got), want.numpy(), atol=1e-9, rtol=1e-9)
    np.testing.assert_allclose(gather_to_numpy(got_grad), want_grad.numpy(), atol=1e-9, rtol=1e-9)
    assert "all_gather_into_tensor" not in comm.get_comm_counts(), comm.get_comm_counts()


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=str)
@pytest.mark.parametrize("config", SPARSE, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
def test_sparse_categorical_crossentropy(config, reduction, weighted):
    check(keras.losses.SparseCategoricalCrossentropy(reduction=reduction, **config), LABELS,
          WEIGHTS if weighted else None)


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=str)
@pytest.mark.parametrize("config", DENSE, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("labels", ["one_hot", "soft"])
def test_categorical_crossentropy(config, reduction, labels):
    check(keras.losses.CategoricalCrossentropy(reduction=reduction, **config),
          ONE_HOT if labels == "one_hot" else SOFT, WEIGHTS)


@pytest.mark.parametrize("fn", ["sparse", "dense"])
def test_tf_nn_counterparts(fn):
    if fn == "sparse":
        def loss_fn(labels, logits, sample_weight=None):
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        check(loss_fn, LABELS)
    else:
        def loss_fn(labels, logits, sample_weight=None):
            return tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        check(loss_fn, SOFT)


def test_masked_vocabulary_minus_inf_logits_stay_finite():
    """-inf logits of non-target classes (a masked vocabulary) on every shard: the loss and its
    gradient are finite and equal numpy's log-softmax (the masked classes get zero gradient)."""
    logits = LOGITS.copy()
    masked = np.ones_like(logits, bool)
    masked[np.arange(B)[:, None], np.arange(S)[None, :], LABELS] = False
    masked &= (np.arange(C) % 3 == 1)  # some classes of each of the 4 shards
    logits[masked] = -np.inf
    finite = np.where(masked, -np.inf, logits)
    peak = finite.max(-1, keepdims=True)
    log_softmax = finite - peak - np.log(np.exp(finite - peak).sum(-1, keepdims=True))
    want = -np.take_along_axis(log_softmax, LABELS[..., None], -1)[..., 0].mean()
    want_grad = (np.exp(log_softmax) - ONE_HOT) / (B * S)
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    logits_d = distribute_tensor(tf.constant(logits), mesh, [Shard(0), Shard(2)]).to_tf()
    labels_d = distribute_tensor(tf.constant(LABELS), mesh, [Shard(0), Replicate()]).to_tf()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with loss_parallel():
        got, got_grad = tf.function(lambda a, b: value_and_grad(loss_fn, a, b, None))(labels_d, logits_d)
    np.testing.assert_allclose(gather_to_numpy(got), want, rtol=1e-12)
    np.testing.assert_allclose(gather_to_numpy(got_grad), want_grad, atol=1e-12)


def test_class_weights_in_fit_equal_one_device():
    """fit(class_weight=...) with loss_parallel on vocabulary-sharded logits."""
    from keras_helpers import DenseAdam, max_weight_diff
    from tfdist.models import GPT, parallelize_gpt

    ids, nxt = RNG.integers(0, 32, (32, 8)), RNG.integers(0, 32, (32, 8))
    class_weight = {c: 1.0 + (c % 3) for c in range(32)}

    def make():
        keras.utils.set_random_seed(0)
        model = GPT(32, 8, dim=16, heads=4, depth=1)
        model(ids[:1])
        return model

    def train(model):
        model.compile(optimizer=DenseAdam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(ids, nxt, batch_size=8, shuffle=False, verbose=0,
                         class_weight=class_weight).history["loss"]

    ref = make()
    want = train(ref)
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(make(), mesh, loss_parallel=True)
    with loss_parallel():
        got = train(model)
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert max_weight_diff(ref, model) < 1e-9


def test_out_of_range_label_in_fit_raises_as_one_device_and_the_process_goes_on():
    """A label of 99 with 32 classes: TF's CPU kernel raises; in tfdist's fit the step checks
    its labels, clips them so every collective completes, and the host raises TF's message after
    the step (tensor/_step_checks.py) -- the process still trains and evaluates."""
    from keras_helpers import DenseAdam
    from tfdist.models import GPT, parallelize_gpt

    ids, nxt = RNG.integers(0, 32, (16, 8)), RNG.integers(0, 32, (16, 8))
    bad = nxt.copy()
    bad[3, 5] = 99
    keras.utils.set_random_seed(0)
    model = GPT(32, 8, dim=16, heads=4, depth=1)
    model(ids[:1])
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(model, mesh, loss_parallel=True)
    model.compile(optimizer=DenseAdam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with loss_parallel():
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"label value of 99 .* range of \[0, 32\)"):
            model.fit(ids, bad, batch_size=8, shuffle=False, verbose=0)
        losses = model.fit(ids, nxt, batch_size=8, shuffle=False, verbose=0).history["loss"]
        after = model.evaluate(ids, nxt, batch_size=8, verbose=0)
    assert np.isfinite(losses).all() and np.isfinite(after)


def test_fit_computes_the_loss_on_sharded_logits_without_a_loss_parallel_block():
    """gpt_tp_plan's default leaves the logits vocabulary-sharded and marks the model, so tfdist's
    fit runs its steps inside loss_parallel(): it trains as one device without a ``with`` block."""
    from keras_helpers import DenseAdam, max_weight_diff
    from tfdist.models import GPT, parallelize_gpt

    ids, nxt = RNG.integers(0, 32, (32, 8)), RNG.integers(0, 32, (32, 8))

    def make():
        keras.utils.set_random_seed(0)
        model = GPT(32, 8, dim=16, heads=4, depth=1)
        model(ids[:1])
        return model

    def train(model):
        model.compile(optimizer=DenseAdam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(ids, nxt, batch_size=8, shuffle=False, verbose=0).history["loss"]

    ref = make()
    want = train(ref)
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(make(), mesh)
    got = train(model)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert max_weight_diff(ref, model) < 1e-5


def test_fit_enters_loss_parallel_to_trace_its_steps_not_to_run_them(monkeypatch):
    """The sharded cross-entropy is in the traced step program; running it again needs no
    ``loss_parallel()`` block (its patches would be swapped in and out on every step).  fit
    enters it once per traced program, and the losses stay one device's."""
    from keras_helpers import DenseAdam
    from tfdist.keras import _trainer
    from tfdist.models import GPT, parallelize_gpt

    ids, nxt = RNG.integers(0, 32, (40, 8)), RNG.integers(0, 32, (40, 8))

    def train(model):
        model.compile(optimizer=DenseAdam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(ids, nxt, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]

    keras.utils.set_random_seed(0)
    ref = GPT(32, 8, dim=16, heads=4, depth=1)
    ref(ids[:1])
    want = train(ref)
    keras.utils.set_random_seed(0)
    model = GPT(32, 8, dim=16, heads=4, depth=1)
    model(ids[:1])
    model = parallelize_gpt(model, tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")))
    entered = []
    block = _trainer.loss_parallel
    monkeypatch.setattr(_trainer, "loss_parallel", lambda: entered.append(1) or block())
    np.testing.assert_allclose(train(model), want, rtol=1e-5)
    assert len(entered) == 1  # 10 steps over 2 epochs, one batch signature: one trace


@pytest.mark.parametrize("target", ["numpy", "tf.Tensor"])
def test_plain_targets_eagerly_and_in_tf_function(target):
    """torch's example passes a plain target next to sharded logits: eagerly, as a traced
    function's argument, and captured by its closure (before: 'got a regular tensor')."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    want = loss_fn(tf.constant(LABELS), tf.constant(LOGITS)).numpy()
    labels = LABELS if target == "numpy" else tf.constant(LABELS)
    _, logits = sharded_logits()
    with loss_parallel():
        eager = loss_fn(labels, logits)
        captured = tf.function(lambda lg: loss_fn(labels, lg))(logits)
        argument = tf.function(lambda y, lg: loss_fn(y, lg))(tf.constant(LABELS), logits)
    for got in (eager, captured, argument):
        np.testing.assert_allclose(gather_to_numpy(got), want, rtol=1e-12)


def test_a_layout_map_with_class_sharded_float64_logits_trains_like_one_device(float64, no_global_distribution):
    """No plan marks these logits: a LayoutMap shards the head's kernel on the class dim, so
    only TF DTensor's layout propagation knows the logits are class-sharded.  fit computes every
    distributed model's sparse cross-entropy inside loss_parallel() (before: TF DTensor's own
    kernel gave a loss of 0 on float64 class-sharded logits, and the weights moved wrongly)."""
    from keras_helpers import max_weight_diff

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 12)), rng.integers(0, 16, (32,))

    def train():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="tanh", name="hidden"),
                                  keras.layers.Dense(16, name="head")])
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history["loss"]
        return model, losses

    ref, want = train()
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["head/kernel"] = (None, "model")
    layout_map["head/bias"] = ("model",)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    model, got = train()
    assert model.get_layer("head").kernel.dtype == "float64"
    np.testing.assert_allclose(got, want, rtol=1e-10)
    assert max_weight_diff(ref, model) < 1e-10


_FORMS = {
    "keras function": lambda y, p: keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True),
    "tf.nn": lambda y, p: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=p),
    "keras class": lambda y, p: keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(y, p),
}


@pytest.mark.parametrize("form", list(_FORMS))
@pytest.mark.parametrize("logits_kind", ["tfdist DTensor", "TF DTensor"])
@pytest.mark.parametrize("labels_kind", ["host", "TF DTensor over dp"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_every_sparse_cross_entropy_form_on_class_sharded_logits(form, logits_kind, labels_kind, traced):
    """torch's loss_parallel example form (a DTensor sharded on its class dim), a raw TF DTensor,
    host or distributed labels, eager or traced: per-example losses and the logits' gradient as
    numpy's."""
    from tensorflow.experimental import dtensor

    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((8, 16)).astype("float32")
    labels = rng.integers(0, 16, (8,)).astype("int32")
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    softmax = shifted / shifted.sum(1, keepdims=True)
    expected = -np.log(softmax[np.arange(8), labels])
    expected_grad = softmax - np.eye(16, dtype="float32")[labels]

    sharded = distribute_tensor(logits, mesh, [Replicate(), Shard(1)])
    x = sharded if logits_kind == "tfdist DTensor" else tf.convert_to_tensor(sharded)
    y = tf.constant(labels)
    if labels_kind != "host":
        y = dtensor.relayout(dtensor.copy_to_mesh(y, dtensor.Layout.replicated(mesh.to_tf(), 1)),
                             dtensor.Layout(["dp"], mesh.to_tf()))
    raw = tf.convert_to_tensor(x)

    def loss_and_grad(y, raw):
        with tf.GradientTape() as tape:
            tape.watch(raw)
            loss = _FORMS[form](y, raw if logits_kind == "TF DTensor" else x)
            total = tf.reduce_sum(tf.convert_to_tensor(loss))
        return loss, tape.gradient(total, raw) if logits_kind == "TF DTensor" else None

    with loss_parallel():
        loss, grad = tf.function(loss_and_grad)(y, raw) if traced else loss_and_grad(y, raw)
    np.testing.assert_allclose(gather_to_numpy(tf.convert_to_tensor(loss)), expected, rtol=1e-5, atol=1e-6)
    if grad is not None:
        np.testing.assert_allclose(gather_to_numpy(grad), expected_grad, rtol=1e-5, atol=1e-6)
