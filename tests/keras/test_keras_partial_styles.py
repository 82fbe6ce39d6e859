"""Partial input/output layouts in the parallel styles, as torch allows them.

``RowwiseParallel(output_layouts=Partial(), use_local_output=False)`` leaves
the row-parallel product unreduced (each device keeps its partial sum, no
collective); the layer that consumes it reduces it straight into the layout
it wants -- an all-reduce for a column-parallel layer (``input_layouts=
Partial()``), a reduce-scatter onto the sequence for ``SequenceParallel`` or
``PrepareModuleInput(..., desired_input_layouts=Shard(1))`` -- and any other
op reads its sum.  Reference: the same model on one device, in float64.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import float64, no_global_distribution  # noqa: F401
from tfdist.keras._data import gather_to_numpy
from tfdist.tensor import Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

pytestmark = pytest.mark.usefixtures("float64")

RNG = np.random.default_rng(5)
X = RNG.standard_normal((8, 8, 16))
IDS = RNG.integers(0, 32, (8, 8))
PARTIAL_OUT = RowwiseParallel(output_layouts=Partial(), use_local_output=False)


class Chain(keras.Model):
    """x + out(norm(down(relu(up(x))))): down's product is left Partial for norm or out to reduce."""

    def __init__(self):
        super().__init__()
        self.up = keras.layers.Dense(32, activation="relu")
        self.down = keras.layers.Dense(16)  # with a bias: counted once in the partial sums
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.out = keras.layers.Dense(16)

    def call(self, x):
        return x + self.out(self.norm(self.down(self.up(x))))


class Lookup(keras.Model):
    """out(emb(ids)): a vocabulary-sharded lookup left Partial."""

    def __init__(self):
        super().__init__()
        self.emb = keras.layers.Embedding(32, 16)
        self.out = keras.layers.Dense(16)

    def call(self, ids):
        return self.out(self.emb(ids))


def make(cls, sample):
    keras.utils.set_random_seed(0)
    model = cls()
    model(sample[:1])
    return model


def loss_and_grads(model, x):
    with tf.GradientTape() as tape:
        if x.dtype.is_floating:
            tape.watch(x)
        y = model(x)
        loss = tf.reduce_sum(tf.sin(y))  # not linear: the gradient depends on every value
    sources = ([x] if x.dtype.is_floating else []) + model.trainable_variables
    return y, loss, tape.gradient(loss, sources)


def assert_equals_one_device(cls, sample, plan, mesh_shape=(2, 4), x_placements=(Shard(0), Replicate())):
    """``plan`` on a ``mesh_shape`` (dp, tp) mesh: outputs, loss and gradients equal one device."""
    keras.distribution.set_distribution(None)
    ref = make(cls, sample)
    r_y, r_loss, r_grads = loss_and_grads(ref, tf.constant(sample))
    mesh = tfdist.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    model = parallelize_module(make(cls, sample), mesh["tp"], plan)
    x = distribute_tensor(tf.constant(sample), mesh, list(x_placements)).to_tf()
    step = tf.function(lambda a: loss_and_grads(model, a))
    y, loss, grads = step(x)
    np.testing.assert_allclose(gather_to_numpy(y), r_y.numpy(), atol=1e-9)
    np.testing.assert_allclose(gather_to_numpy(loss), r_loss.numpy(), atol=1e-9)
    assert len(grads) == len(r_grads)
    for a, b in zip(r_grads, grads):
        np.testing.assert_allclose(gather_to_numpy(tf.convert_to_tensor(b)), tf.convert_to_tensor(a).numpy(),
                                   atol=1e-9)
    return model, x, step


CHAIN_PLANS = {
    "colwise_reduces": {  # torch: out's input_layouts=Partial() -> redistribute to Replicate
        "up": ColwiseParallel(), "down": PARTIAL_OUT,
        "out": ColwiseParallel(input_layouts=Partial(), output_layouts=Replicate()),
    },
    "sequence_parallel_reduces": {  # the norm takes the Partial onto the sequence: a reduce-scatter
        "up": ColwiseParallel(), "down": PARTIAL_OUT, "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    },
    "unstyled_reads_the_sum": {"up": ColwiseParallel(), "down": PARTIAL_OUT},
}


@pytest.mark.parametrize("plan", list(CHAIN_PLANS), ids=list(CHAIN_PLANS))
def test_partial_output_reduced_by_its_consumer_equals_one_device(plan):
    assert_equals_one_device(Chain, X, CHAIN_PLANS[plan])


def test_partial_output_is_a_partial_dtensor_and_costs_no_collective():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(make(Chain, X), mesh["tp"], {"up": ColwiseParallel(), "down": PARTIAL_OUT})
    x = distribute_tensor(tf.constant(X), mesh, [Shard(0), Replicate()]).to_tf()
    hidden = tf.function(lambda a: model.down(model.up(a)))
    out = hidden(x)
    assert isinstance(out, tfdist.tensor.DTensor)
    assert tuple(out.placements) == (Shard(0), Partial("sum"))
    assert tuple(out.shape) == (8, 8, 16)
    with CommDebugMode() as comm:
        hidden(x)
    assert comm.get_comm_counts() == {}
    ref = make(Chain, X)
    np.testing.assert_allclose(out.full_tensor().numpy(), ref.down(ref.up(tf.constant(X))).numpy(), atol=1e-9)


@pytest.mark.parametrize(
    "plan, counts",
    [  # out's output_layouts=Replicate() adds its own all-gather of the features in both
        ("colwise_reduces", {"all_reduce": 1, "all_gather_into_tensor": 1}),
        ("sequence_parallel_reduces", {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 2}),
    ],
)
def test_the_consumer_runs_torchs_one_collective(plan, counts):
    """Deferred to the consumer, the reduction is still one collective of torch's kind: an
    all-reduce into a column-parallel layer's replicated input, a reduce-scatter into a
    sequence shard (never an all-reduce followed by a slice)."""
    mesh = tfdist.init_device_mesh("cpu", (1, 8), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(make(Chain, X), mesh["tp"], CHAIN_PLANS[plan])
    x = distribute_tensor(tf.constant(X), mesh, [Replicate(), Replicate()]).to_tf()
    if plan == "colwise_reduces":  # the Partial straight into out, whose input_layouts say Partial
        forward = tf.function(lambda a: model.out(model.down(model.up(a))))
    else:
        forward = tf.function(lambda a: model.out(model.norm(model.down(model.up(a)))))
    forward(x)
    with CommDebugMode() as comm:
        forward(x)
    assert comm.get_comm_counts() == counts


def test_partial_embedding_reduced_onto_the_sequence_equals_one_device():
    """torch's vocabulary-parallel embedding with its reduction moved to the next module's
    PrepareModuleInput (Partial -> Shard(1): a reduce-scatter)."""
    plan = {
        "emb": PARTIAL_OUT,
        "out": PrepareModuleInput(input_layouts=Partial(), desired_input_layouts=Shard(1)),
    }
    model, x, _ = assert_equals_one_device(Lookup, IDS, plan)
    with CommDebugMode() as comm:
        tf.function(lambda a: model.out(model.emb(a)))(x)
    assert comm.get_comm_counts().get("all_reduce", 0) == 0


def test_partial_output_trains_with_fit_like_one_device():
    keras.distribution.set_distribution(None)
    y = RNG.standard_normal((8, 8, 16))
    ref = make(Chain, X)
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ref_hist = ref.fit(X, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(make(Chain, X), mesh["tp"], CHAIN_PLANS["sequence_parallel_reduces"])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    hist = model.fit(X, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(hist, ref_hist, rtol=1e-9)
    for a, b in zip(ref.weights, model.weights):
        np.testing.assert_allclose(gather_to_numpy(tf.convert_to_tensor(b)), a.numpy(), atol=1e-9)


# -- what cannot be Partial, refused with the reason ------------------------------------------

def test_partial_output_needs_use_local_output_false():
    with pytest.raises(ValueError, match="use_local_output=False"):
        RowwiseParallel(output_layouts=Partial())


def test_partial_output_must_be_a_sum():
    with pytest.raises(ValueError, match=r"Partial\('sum'\)"):
        RowwiseParallel(output_layouts=Partial("max"), use_local_output=False)


def test_a_tf_tensor_cannot_be_laid_out_as_partial():
    from tfdist.tensor.parallel import PrepareModuleOutput

    mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    model = parallelize_module(make(Chain, X), mesh, {
        "out": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Partial())})
    with pytest.raises(ValueError, match="cannot lay a tensor out"):
        model.out(tf.constant(X))


def test_colwise_output_cannot_be_partial():
    with pytest.raises(ValueError, match="output_layouts"):
        ColwiseParallel(output_layouts=Partial())


def test_partial_output_after_a_nonlinear_activation_is_refused_before_any_change():
    mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    model = make(Chain, X)
    with pytest.raises(ValueError, match="'relu'"):
        parallelize_module(model, mesh, {"up": PARTIAL_OUT})
    assert tf.experimental.dtensor.is_dtensor(model.up.kernel.value) is False  # nothing was laid out


def test_partial_input_that_arrives_as_a_tf_tensor_is_read_as_its_global_value():
    """torch applies input_layouts to local tensors only; a DTensor's own placements win. A TF
    tensor carries its layout like a DTensor (and a Partial can only leave a style as a tfdist
    DTensor), so a column-parallel layer declared Partial takes it as it is."""
    mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    model = parallelize_module(make(Chain, X), mesh, {"out": ColwiseParallel(input_layouts=Partial())})
    ref = make(Chain, X)
    np.testing.assert_allclose(gather_to_numpy(model.out(tf.constant(X))), ref.out(tf.constant(X)).numpy(),
                               atol=1e-9)
