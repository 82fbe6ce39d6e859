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
from tfdist.fsdp.wrap import (
    CustomPolicy, ModuleWrapPolicy, always_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
)
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


def test_transformer_and_custom_policies_choose_units_and_their_arguments(float64):
    """torch's function policy wraps the blocks; a CustomPolicy dict gives block 0 its own strategy (NO_SHARD:
    whole kernels on every device) while block 1 keeps the root's FULL_SHARD; training equals one device's."""
    blocks = FSDP(make_gpt(), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                 transformer_layer_cls={Block}), device_mesh=mesh8())
    assert all(isinstance(b, FSDP) for b in blocks.blocks) and not isinstance(blocks.head, FSDP)

    ref_loss = fit(ref := make_gpt())
    gpt = make_gpt()
    first = gpt.blocks[0]
    policy = CustomPolicy(lambda layer: {"sharding_strategy": ShardingStrategy.NO_SHARD} if layer is first
                          else isinstance(layer, Block))
    model = FSDP(gpt, auto_wrap_policy=policy, device_mesh=mesh8())
    assert all(isinstance(b, FSDP) for b in model.blocks)
    local = [tf.experimental.dtensor.unpack(b.mlp.up.kernel._value.read_value())[0].shape[0] for b in model.blocks]
    assert local == [16, 2]  # 16 rows whole on block 0, 16 / 8 on block 1
    np.testing.assert_allclose(fit(model), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    with pytest.raises(ValueError, match="got FSDP arguments \\['reshard_after_forward'\\]"):
        FSDP(make_gpt(), auto_wrap_policy=CustomPolicy(lambda layer: {"reshard_after_forward": True}),
             device_mesh=mesh8())
    with pytest.raises(TypeError, match="return a bool or a dict"):
        FSDP(make_gpt(), auto_wrap_policy=CustomPolicy(lambda layer: "yes"), device_mesh=mesh8())


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


def test_mixed_precision_keeps_master_weights():
    model = FSDP(make_gpt(), device_mesh=mesh8(), mixed_precision=MixedPrecision(param_dtype="bfloat16",
                                                                                  reduce_dtype="float32"))
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    model.compile(optimizer="adam", loss=SCE)
    history = model.fit(IDS, NEXT, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_batch_norms_are_their_own_full_precision_units():
    """torch's ``MixedPrecision._module_classes_to_ignore`` (its batch norms by default, Keras'
    ``BatchNormalization`` here): with an auto-wrap policy each such layer is a unit of its own
    without mixed precision, the rest computes in ``param_dtype``; without a policy, no unit."""
    from tfdist import _registry

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="up"),
                                 keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(4, name="down")])

    model = FSDP(make(), device_mesh=mesh8(), auto_wrap_policy=ModuleWrapPolicy({keras.layers.Dense}),
                 mixed_precision=MixedPrecision(param_dtype="bfloat16"))
    unit = {name: _registry.module(model.get_layer(name)).fsdp for name in ("up", "bn", "down")}
    assert all(u is not None for u in unit.values())
    assert unit["bn"].mp.param_dtype is None
    assert tf.as_dtype(unit["up"].mp.param_dtype) == tf.bfloat16 == tf.as_dtype(unit["down"].mp.param_dtype)
    model.compile(optimizer="sgd", loss="mse")
    x = RNG.standard_normal((16, 8)).astype("float32")
    assert np.isfinite(model.fit(x, x[:, :4], batch_size=16, epochs=1, verbose=0).history["loss"][0])

    kept = FSDP(make(), device_mesh=mesh8(), auto_wrap_policy=ModuleWrapPolicy({keras.layers.Dense}),
                mixed_precision=MixedPrecision(param_dtype="bfloat16", _module_classes_to_ignore=()))
    assert _registry.module(kept.get_layer("bn")).fsdp is None  # in the root unit, in bfloat16
    with pytest.raises(TypeError, match="_module_classes_to_ignore"):
        MixedPrecision(_module_classes_to_ignore=["BatchNormalization"])


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"HYBRID_SHARD takes a 2-D \(replicate, shard\) device_mesh"):
        FSDP(make_gpt(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh8())
    with pytest.raises(ValueError, match="FULL_SHARD takes a 1-D device_mesh"):
        FSDP(make_gpt(), device_mesh=tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("r", "s")))
    with pytest.raises(ValueError, match="process_group"):
        FSDP(make_gpt(), process_group=object())
    with pytest.raises(ValueError, match="cpu_offload"):
        FSDP(make_gpt(), cpu_offload=True)
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDP(make_gpt(), sharding_strategy="FULL_SHARD")
    model = make_gpt()
    fully_shard(model, mesh=mesh8())
    with pytest.raises(ValueError, match="already"):
        FSDP(model)


def test_state_dict_types_round_trip(float64):
    from tfdist.fsdp import FullStateDictConfig, StateDictType
    from tfdist.tensor import DTensor, Shard

    model = FSDP(make_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_mesh=mesh8())
    plain = make_gpt()  # the same seed: the same weights, unsharded
    full = model.state_dict()  # FULL by default
    assert "blocks.0.mlp.up.kernel" in full and "tok.embeddings" in full
    for name, value in full.items():
        assert isinstance(value, np.ndarray)
    from tfdist.fsdp._state_dict import named_weights

    reference = {name: v.numpy() for name, v in named_weights(plain).items()}  # torch-style names
    assert set(reference) == set(full)
    for name, value in reference.items():
        np.testing.assert_array_equal(full[name], value)

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
        up = sharded["blocks.0.mlp.up.kernel"]
        assert isinstance(up, DTensor) and up.placements == (Shard(0),)
        assert tuple(up.to_local().shape) == (2, 64)
        zeros = {k: (DTensor.from_tf(tf.zeros_like(v.to_tf())) if isinstance(v, DTensor) else v * 0)
                 for k, v in sharded.items()}
        model.load_state_dict(zeros)
        assert float(np.abs(model.blocks[0].mlp.up.kernel.numpy()).max()) == 0.0
        model.load_state_dict(sharded)
    np.testing.assert_array_equal(model.blocks[0].mlp.up.kernel.numpy(), full["blocks.0.mlp.up.kernel"])

    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        assert len(local["blocks.0.mlp.up.kernel"]) == 8 and tuple(local["blocks.0.mlp.up.kernel"][3].shape) == (2, 64)
        model.load_state_dict(local)
    previous = FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True))
    assert previous.state_dict_type == StateDictType.FULL_STATE_DICT
    assert FSDP.get_state_dict_type(model).state_dict_config.rank0_only
    assert set(model.state_dict()) == set(full)  # this process is rank 0
    bad = dict(full)
    bad["blocks.0.mlp.up.kernel"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match="shape"):
        model.load_state_dict(bad)
    np.testing.assert_array_equal(model.blocks[0].mlp.up.kernel.numpy(), full["blocks.0.mlp.up.kernel"])
    with pytest.raises(ValueError, match="missing"):
        model.load_state_dict({})
    with pytest.raises(ValueError, match="FullStateDictConfig"):
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, object())


def test_optim_state_dict_round_trip():
    from tfdist.fsdp import StateDictType
    from tfdist.tensor import DTensor

    model = FSDP(make_gpt(), device_mesh=mesh8())
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=SCE)
    model.fit(IDS[:16], NEXT[:16], batch_size=16, epochs=1, verbose=0)
    osd = FSDP.optim_state_dict(model, model.optimizer)
    assert set(osd["state"]["blocks.0.mlp.up.kernel"]) == {"momentum", "velocity"}
    assert osd["param_groups"][0]["learning_rate"] == pytest.approx(1e-3)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(model, model.optimizer)
        assert isinstance(sharded["state"]["blocks.0.mlp.up.kernel"]["momentum"], DTensor)
    for slot in model.optimizer.variables:
        if len(slot.shape):
            slot.assign(np.zeros(slot.shape))
    FSDP.optim_state_dict_to_load(model, model.optimizer, osd)
    again = FSDP.optim_state_dict(model, model.optimizer)
    np.testing.assert_array_equal(again["state"]["blocks.0.mlp.up.kernel"]["velocity"],
                                  osd["state"]["blocks.0.mlp.up.kernel"]["velocity"])


def constant_init(layer):
    """A param_init_fn: every weight of ``layer`` a deterministic pattern (what a reset_parameters does)."""
    for i, w in enumerate(layer.weights):
        w.assign(np.sin(np.arange(np.prod(w.shape)).reshape(w.shape) + i) * 0.1)


def test_param_init_fn_initialises_every_layer_before_sharding(float64):
    """torch calls param_init_fn on the modules it materialises; here on every layer with weights.
    The sharded model then trains like a one-device model initialised the same way by hand."""
    ref = make_gpt()
    for layer in ref._flatten_layers(include_self=True):
        if layer.weights and not layer._layers:
            constant_init(layer)
    seen = []
    model = FSDP(make_gpt(), device_mesh=mesh8(), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 param_init_fn=lambda layer: (seen.append(layer.name), constant_init(layer)))
    assert "query" in seen and len(seen) >= len(model.blocks) * 4
    assert max_weight_diff(ref, model) < 1e-15
    np.testing.assert_allclose(fit(model), fit(ref), rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    with pytest.raises(ValueError, match="param_init_fn"):
        FSDP(make_gpt(), device_mesh=mesh8(), param_init_fn="zeros")


def test_sync_module_states_on_one_client_keeps_the_weights():
    ref = make_gpt()
    model = FSDP(make_gpt(), device_mesh=mesh8(), sync_module_states=True)
    assert max_weight_diff(ref, model) == 0
