"""Gradient accumulation without a reduction per micro-batch: ``set_requires_gradient_sync(False)``
and FSDP1's ``no_sync()`` hold each gradient unreduced (no collective), and the synchronizing
backward reduce-scatters the sum once -- the gradients of all micro-batches on one device."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import no_global_distribution, sum_sq_grads, traced_sum_sq_grads  # noqa: F401
from tfdist.fsdp import FullyShardedDataParallel as FSDP
from tfdist.fsdp import fully_shard
from tfdist.keras._data import gather_to_numpy
from tfdist.tensor.debug import CommDebugMode

RNG = np.random.default_rng(3)
N = 8
MICRO = [tf.constant(RNG.standard_normal((16, 64)), tf.float32) for _ in range(3)]


class Affine(keras.layers.Layer):
    """A user's own layer (FSDP runs it per shard: reduce-scattered like a Dense)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 32), initializer="glorot_uniform", name="w")

    def call(self, x):
        return tf.tanh(tf.matmul(x, self.w))


class ColumnMean(keras.layers.Layer):
    """Not row-wise: the gathered route, whose gradient TF all-reduces inside the op."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="glorot_uniform", name="w")

    def call(self, x):
        return tf.reduce_mean(tf.matmul(x, self.w), axis=0, keepdims=True)


def make(tail=None):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((64,)), keras.layers.Dense(64, name="d0"), Affine(name="a"), keras.layers.Dense(8, name="d1")]
    return keras.Sequential(layers + ([tail] if tail is not None else []))


def shard_each(model):
    mesh = tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def summed_reference(model):
    """One device: the gradients of each micro-batch, summed (what torch's synced grad holds)."""
    per_micro = [sum_sq_grads(model, x) for x in MICRO]
    return [sum(g.numpy() for g in gs) for gs in zip(*per_micro)]


def assert_grads(got, want):
    for a, b in zip(want, got):
        np.testing.assert_allclose(gather_to_numpy(b), a, rtol=2e-5, atol=2e-5)


def test_held_micro_batches_are_reduce_scattered_once():
    """Traced step, the flag a Python argument: the two held micro-batches run no reduction and
    give zero gradients; the synchronizing one reduce-scatters once, (N-1)/N of the parameter
    bytes -- a third of syncing each micro-batch -- and its gradients are the sum of all three."""
    want = summed_reference(make())
    model = shard_each(make())

    @tf.function
    def step(x, sync):
        model.set_requires_gradient_sync(sync)
        return sum_sq_grads(model, x)

    comms = []
    for i, x in enumerate(MICRO):
        with CommDebugMode() as comm:
            grads = step(x, i == len(MICRO) - 1)
        comms.append(comm)
        if i < len(MICRO) - 1:
            assert all(not np.any(gather_to_numpy(g)) for g in grads)
    for comm in comms[:-1]:
        assert set(comm.get_comm_counts()) == {"all_gather_into_tensor"}, comm.get_comm_counts()
    param_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert comms[-1].get_comm_counts()["reduce_scatter_tensor"] == 5  # d0 kernel+bias, a.w, d1 kernel+bias
    assert comms[-1].get_comm_bytes()["reduce_scatter_tensor"] == pytest.approx(param_bytes * (N - 1) / N)
    assert_grads(grads, want)

    synced = step(MICRO[0], True)  # nothing held any more: one micro-batch's gradients
    assert_grads(synced, sum_sq_grads(make(), MICRO[0]))


def test_eager_and_recurse_false_holds_only_the_modules_own_group():
    """Eager: each change is seen at once.  recurse=False on the root holds the root's group
    only (here: nothing of its own), so the layers' groups still reduce every micro-batch."""
    want = summed_reference(make())
    model = shard_each(make())
    model.set_requires_gradient_sync(False)
    for x in MICRO[:-1]:
        sum_sq_grads(model, x)
    model.set_requires_gradient_sync(True)
    assert_grads(sum_sq_grads(model, MICRO[-1]), want)

    model.set_requires_gradient_sync(False, recurse=False)
    one = sum_sq_grads(model, MICRO[0])
    assert_grads(one, sum_sq_grads(make(), MICRO[0]))
    with pytest.raises(ValueError, match="requires_gradient_sync.*Received: 'no'"):
        model.set_requires_gradient_sync("no")


def test_gathered_route_is_held_as_its_slice():
    """A layer FSDP cannot run per shard: TF still all-reduces its gradient inside the op (that
    communication is TF's), but the sum over micro-batches is the same."""
    want = summed_reference(make(ColumnMean(name="mean")))
    model = shard_each(make(ColumnMean(name="mean")))
    model.set_requires_gradient_sync(False)
    held = [sum_sq_grads(model, x) for x in MICRO[:-1]]
    assert all(not np.any(gather_to_numpy(g)) for g in held[-1])
    model.set_requires_gradient_sync(True)
    assert_grads(sum_sq_grads(model, MICRO[-1]), want)


def test_fsdp1_no_sync_holds_inside_the_block_and_restores():
    want = summed_reference(make())
    model = FSDP(make(), device_mesh=tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",)))
    with model.no_sync():
        for x in MICRO[:-1]:
            assert all(not np.any(gather_to_numpy(g)) for g in sum_sq_grads(model, x))
    assert_grads(sum_sq_grads(model, MICRO[-1]), want)


def test_keras_fit_retraces_after_the_setting_changes():
    """A Keras model's cached train step was traced with the old setting: it is dropped."""
    model = shard_each(make())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.concatenate([m.numpy() for m in MICRO]), np.zeros((48, 8), np.float32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = [v.numpy() for v in model.trainable_variables]
    model.set_requires_gradient_sync(False)
    assert model.train_function is None
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # zero gradients: SGD leaves the weights
    for a, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), a)


# -- FSDP1 communication hooks (the same choke point: what reduces the stacked gradient) ------------

def test_fsdp1_comm_hooks_reduce_the_stacked_gradient():
    """fp16_compress_hook: the reduce-scatter in float16 (half the bytes), values close to one device;
    a custom hook scaling before FSDP's reduce-scatter scales the result exactly; allreduce_hook
    all-reduces (NO_SHARD's reduction) and equals one device."""
    from tfdist.algorithms._comm_hooks import default_hooks

    x = MICRO[0]
    want = sum_sq_grads(make(), x)
    mesh = tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))

    def traced(model):
        return traced_sum_sq_grads(model, x)

    plain, plain_comm = traced(FSDP(make(), device_mesh=mesh))
    model = FSDP(make(), device_mesh=mesh)
    model.register_comm_hook(default_hooks.LowPrecisionState(), default_hooks.fp16_compress_hook)
    grads, comm = traced(model)
    assert comm.get_comm_counts()["reduce_scatter_tensor"] == plain_comm.get_comm_counts()["reduce_scatter_tensor"]
    assert comm.get_comm_bytes()["reduce_scatter_tensor"] == pytest.approx(
        plain_comm.get_comm_bytes()["reduce_scatter_tensor"] / 2)
    for a, b in zip(want, grads):
        np.testing.assert_allclose(gather_to_numpy(b), a.numpy(), rtol=2e-2, atol=2e-2)
    assert_grads(plain, [g.numpy() for g in want])

    model = FSDP(make(), device_mesh=mesh)
    model.register_comm_hook(None, lambda state, g: default_hooks.reduce_scatter_in_hook(g * 0.5))
    assert_grads(traced(model)[0], [0.5 * g.numpy() for g in want])

    model = FSDP(make(), device_mesh=mesh)
    model.register_comm_hook(default_hooks.DefaultState(), default_hooks.allreduce_hook)
    grads, comm = traced(model)
    assert "reduce_scatter_tensor" not in comm.get_comm_counts() and comm.get_comm_counts()["all_reduce"] >= 5
    assert_grads(grads, [g.numpy() for g in want])
    with pytest.raises(RuntimeError, match="already registered"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)


def test_fsdp1_comm_hook_on_a_unit_or_bad_output_is_refused():
    from tfdist.algorithms._comm_hooks import default_hooks
    from tfdist.fsdp.wrap import ModuleWrapPolicy

    mesh = tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))
    model = FSDP(make(), auto_wrap_policy=ModuleWrapPolicy({keras.layers.Dense}), device_mesh=mesh)
    with pytest.raises(ValueError, match="root"):
        model.layers[0].register_comm_hook(None, default_hooks.allreduce_hook)
    model.register_comm_hook(None, lambda state, g: g)  # the unreduced stack: the wrong shape
    with pytest.raises(ValueError, match="must return the reduced gradient"):
        sum_sq_grads(model, MICRO[0])
    with pytest.raises(RuntimeError, match="inside an FSDP communication hook"):
        default_hooks.reduce_scatter_in_hook(tf.zeros([8, 2]))
