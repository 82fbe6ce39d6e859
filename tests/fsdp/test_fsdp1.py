"""The FSDP1 API (FullyShardedDataParallel) on Keras models: strategies, wrap policies, helpers."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import DenseAdam, float64, max_weight_diff, no_global_distribution  # noqa: F401
from tfdist.fsdp import (
    CPUOffload, FSDPModule, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, fully_shard,
)
from tfdist.fsdp.wrap import ModuleWrapPolicy, always_wrap_policy, size_based_auto_wrap_policy
from tfdist.keras._data import gather_to_numpy
from tfdist.models import GPT
from tfdist.models.gpt import Block
from tfdist.tensor.debug import CommDebugMode

RNG = np.random.default_rng(1)
V, S = 32, 8
IDS = RNG.integers(0, V, (64, S))
NEXT = RNG.integers(0, V, (64, S))
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mesh8():
    return tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))


def make_gpt():
    keras.utils.set_random_seed(0)
    model = GPT(V, S, dim=16, heads=4, depth=2)
    model(IDS[:1])
    return model


def fit(model):
    model.compile(optimizer=DenseAdam(1e-2), loss=SCE)
    return model.fit(IDS, NEXT, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                                      ShardingStrategy.NO_SHARD], ids=lambda s: s.name)
def test_strategies_train_like_one_device(float64, strategy):
    ref = make_gpt()
    ref_loss = fit(ref)
    model = FSDP(make_gpt(), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 device_mesh=mesh8())
    assert isinstance(model, FSDP) and isinstance(model, FSDPModule) and model.check_is_root()
    assert all(isinstance(b, FSDP) and not b.check_is_root() for b in model.blocks)
    loss = fit(model)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    kernel = model.blocks[0].mlp.up.kernel
    local = tf.experimental.dtensor.unpack(kernel._value.read_value())[0].shape
    assert local[0] == (16 if strategy == ShardingStrategy.NO_SHARD else 2)


def test_no_shard_is_ddp_all_reduce():
    model = FSDP(make_gpt(), sharding_strategy=ShardingStrategy.NO_SHARD, device_mesh=mesh8())
    @tf.function
    def step(ids, labels):
        with tf.GradientTape() as tape:
            loss = SCE(labels, model(ids))
        return tape.gradient(loss, model.trainable_variables)

    with CommDebugMode() as comm:
        step(tf.constant(IDS[:16]), tf.constant(NEXT[:16]))
    counts = comm.get_comm_counts()
    assert "all_gather_into_tensor" not in counts and counts.get("all_reduce", 0) >= 1


def test_wrap_policies_choose_units():
    # each block holds ~3.3k parameters; none of its sublayers reaches 2.5k (the MLP: 2.1k)
    size_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=2500)
    model = FSDP(make_gpt(), auto_wrap_policy=size_policy, device_mesh=mesh8())
    assert all(isinstance(b, FSDP) for b in model.blocks)
    assert not isinstance(model.blocks[0].mlp.up, FSDP)
    small = FSDP(make_gpt(), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
                 device_mesh=mesh8())  # the MLP's Dense layers (~1.1k each) become units first
    assert isinstance(small.blocks[0].mlp.up, FSDP) and not isinstance(small.blocks[0], FSDP)
    every = FSDP(make_gpt(), auto_wrap_policy=always_wrap_policy, device_mesh=mesh8())
    assert isinstance(every.blocks[0].mlp.up, FSDP) and isinstance(every.head, FSDP)
    with pytest.raises(ValueError, match="layer classes"):
        ModuleWrapPolicy([])


def test_clip_grad_norm_matches_numpy():
    model = FSDP(make_gpt(), device_mesh=mesh8())
    with tf.GradientTape() as tape:
        loss = SCE(NEXT[:16], model(IDS[:16]))
    grads = tape.gradient(loss, model.trainable_variables)
    flat = np.concatenate([gather_to_numpy(tf.convert_to_tensor(g)).ravel() for g in grads])
    expected = float(np.linalg.norm(flat))
    total = model.clip_grad_norm_(0.1, grads=grads)
    assert abs(float(gather_to_numpy(total)) - expected) < 1e-4 * expected
    clipped = np.concatenate([gather_to_numpy(tf.convert_to_tensor(g)).ravel() for g in grads])
    np.testing.assert_allclose(np.linalg.norm(clipped), 0.1, rtol=1e-3)
    inf_total = model.clip_grad_norm_(1e9, norm_type=float("inf"), grads=grads)
    np.testing.assert_allclose(float(gather_to_numpy(inf_total)), np.abs(clipped).max(), rtol=1e-5)


def test_summon_full_params_writeback(float64):
    model = FSDP(make_gpt(), device_mesh=mesh8())
    kernel = model.blocks[0].mlp.up.kernel
    before = kernel.numpy().copy()
    with FSDP.summon_full_params(model, writeback=False):
        assert kernel.numpy().shape == (16, 64)
        kernel.assign(np.zeros((16, 64)))
        assert float(np.abs(kernel.numpy()).max()) == 0.0
    np.testing.assert_array_equal(kernel.numpy(), before)
    with FSDP.summon_full_params(model):
        kernel.assign(kernel * 2)
    np.testing.assert_allclose(kernel.numpy(), 2 * before)
    with pytest.raises(ValueError, match="rank0_only"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass


def test_no_sync_warns_and_mixed_precision_keeps_master_weights():
    model = FSDP(make_gpt(), device_mesh=mesh8(), mixed_precision=MixedPrecision(param_dtype="bfloat16",
                                                                                  reduce_dtype="float32"))
    with pytest.warns(UserWarning, match="no_sync"):
        with model.no_sync():
            pass
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    model.compile(optimizer="adam", loss=SCE)
    history = model.fit(IDS, NEXT, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="hybrid"):
        FSDP(make_gpt(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh8())
    with pytest.raises(ValueError, match="process_group"):
        FSDP(make_gpt(), process_group=object())
    with pytest.raises(NotImplementedError, match="CPUOffload"):
        FSDP(make_gpt(), cpu_offload=CPUOffload(offload_params=True))
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDP(make_gpt(), sharding_strategy="FULL_SHARD")
    model = make_gpt()
    fully_shard(model, mesh=mesh8())
    with pytest.raises(ValueError, match="already"):
        FSDP(model)
