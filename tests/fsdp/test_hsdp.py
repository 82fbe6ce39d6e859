"""HSDP: ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh (and FSDP1's HYBRID_SHARD).

References: one device's training of the same seeded model (the batch over all 8 devices must
give the one-device gradient), and torch's HSDP plan derived by hand for the collectives: per
parameter one reduce-scatter over ``shard`` of the whole gradient and one all-reduce over
``replicate`` of its shard."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
from keras_helpers import float64, max_weight_diff, no_global_distribution  # noqa: F401
from keras_helpers import make_mlp as make_mlp_16_32_8
from tfdist.fsdp import (
    DataParallelMeshDims, FSDPMeshInfo, FullyShardedDataParallel, ShardingStrategy, ShardPlacementResult, fully_shard,
)
from tfdist.tensor.debug import CommDebugMode
from test_fully_shard import IDS, NEXT, SCE, X, Y, fit, local_shape, make_gpt, make_mlp, shard_gpt


def hsdp_mesh(shape):
    return tfdist.init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def shard_mlp(model, mesh, **kwargs):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_mlp_fit_equals_one_device(float64, shape):
    """51 samples in batches of 16 over R x S devices, and a last batch of 3 (replicated)."""
    ref = make_mlp()
    ref_loss = fit(ref, X, Y, "mse")
    model = shard_mlp(make_mlp(), hsdp_mesh(shape))
    up = model.get_layer("up").kernel  # [16, 32]: sharded over shard, the same on every replica group
    assert dtensor.fetch_layout(up._value.read_value()).sharding_specs == ["shard", dtensor.UNSHARDED]
    assert local_shape(up) == (16 // shape[1], 32)
    np.testing.assert_allclose(fit(model, X, Y, "mse"), ref_loss, rtol=1e-6)  # Keras' loss tracker: float32
    assert max_weight_diff(ref, model) < 1e-12


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_gpt_fit_equals_one_device(float64, shape):
    """Embeddings, attention (a layer FSDP runs per shard), norms, the head: every kind of
    parameter, with Adam on dense gradients as the reference takes them."""
    ref = make_gpt()
    ref_loss = fit(ref, IDS, NEXT, SCE)
    model = shard_gpt(make_gpt(), hsdp_mesh(shape))
    np.testing.assert_allclose(fit(model, IDS, NEXT, SCE), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_collectives_per_step_are_torchs_hsdp_plan(shape):
    """One traced backward of the MLP (16 -> 32 -> 8, every dim divisible by S): per parameter one
    reduce-scatter over shard of its whole gradient ((S-1)/S of its bytes) and one all-reduce over
    replicate of its shard (ring: 2(R-1)/R of the shard's bytes), as torch's HSDP; the all-gathers
    are the forward's, the backward's regather of the last kernel and the outputs' gather over
    shard (Keras takes the outputs as [B, ...])."""
    r, s = shape
    mesh = hsdp_mesh(shape)
    model = shard_mlp(make_mlp_16_32_8(), mesh)
    tf_mesh = mesh.to_tf()
    x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(X[:16], tf.float32), dtensor.Layout.replicated(tf_mesh, 2)),
                         dtensor.Layout(["replicate", dtensor.UNSHARDED], tf_mesh))

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            y = model(x)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, model.trainable_variables)

    grads(x)
    with CommDebugMode() as comm:
        grads(x)
    counts, sent = comm.get_comm_counts(), comm.get_comm_bytes()
    params = len(model.trainable_variables)
    total = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert counts["reduce_scatter_tensor"] == params and counts["all_reduce"] == params, counts
    assert sent["reduce_scatter_tensor"] == pytest.approx(total * (s - 1) / s)
    assert sent["all_reduce"] == pytest.approx(total / s * 2 * (r - 1) / r)
    down, out_rows = 4 * 32 * 8, 4 * 8 * 16 // r  # the regathered kernel; a group's outputs
    assert counts["all_gather_into_tensor"] == params + 2, counts
    assert sent["all_gather_into_tensor"] == pytest.approx((total + down + out_rows) * (s - 1) / s)


def test_gradients_equal_one_devices_in_a_custom_loop(float64):
    """The gradients of a tf.function step (no Keras fit) equal one device's, each arriving as
    its shard on 'shard', replicated over 'replicate'."""
    ref = make_mlp()
    xs = tf.constant(X[:16])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ref(xs) ** 2)
    expected = tape.gradient(loss, ref.trainable_variables)
    model = shard_mlp(make_mlp(), hsdp_mesh((2, 4)))
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    from tfdist.keras._data import gather_to_numpy

    for got, want in zip(step(xs), expected):
        assert dtensor.fetch_layout(got).sharding_specs[0] in ("shard", dtensor.UNSHARDED)
        np.testing.assert_allclose(gather_to_numpy(got), want.numpy(), rtol=1e-10, atol=1e-12)


def test_dp_mesh_dims_and_placement_results_name_hsdps_dims(float64):
    """``dp_mesh_dims`` names the two dims of any 2-D mesh; a ``ShardPlacementResult`` on the
    group's (replicate, shard) dims is its placement, other dims are refused; a third mesh dim and
    replicate-only dims are refused."""
    mesh = tfdist.init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b"))
    dims = DataParallelMeshDims(shard="a", replicate="b")  # shard over the first dim this time
    ref = make_mlp()
    ref_loss = fit(ref, X[:32], Y[:32], "mse", epochs=1)
    placed = ShardPlacementResult(None, FSDPMeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=1))
    model = shard_mlp(make_mlp(), mesh, dp_mesh_dims=dims, shard_placement_fn=lambda v: placed)
    assert local_shape(model.get_layer("up").kernel) == (4, 32)
    np.testing.assert_allclose(fit(model, X[:32], Y[:32], "mse", epochs=1), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-12
    wrong = ShardPlacementResult(None, FSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0))
    with pytest.raises(ValueError, match="own mesh dims"):
        fully_shard(make_mlp(), mesh=mesh, dp_mesh_dims=dims, shard_placement_fn=lambda v: wrong)
    cube = tfdist.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("r", "s", "tp"))
    with pytest.raises(ValueError, match="third mesh dim"):
        fully_shard(make_mlp(), mesh=cube, dp_mesh_dims=DataParallelMeshDims(shard="s", replicate="r"))
    with pytest.raises(ValueError, match="1-D .FSDP. or 2-D"):
        fully_shard(make_mlp(), mesh=cube)


@pytest.mark.parametrize("strategy", [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2])
def test_fsdp1_hybrid_shard_trains_like_one_device(float64, strategy):
    ref = make_mlp()
    ref_loss = fit(ref, X[:48], Y[:48], "mse")
    model = FullyShardedDataParallel(make_mlp(), device_mesh=hsdp_mesh((2, 4)), sharding_strategy=strategy)
    assert local_shape(model.get_layer("up").kernel) == (4, 32)
    np.testing.assert_allclose(fit(model, X[:48], Y[:48], "mse"), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-12


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_keras_hub_models_under_hsdp_train_like_one_device(family):
    """Third-party models: keras-hub's Llama and Gemma causal LMs (their norms and rotary
    attention run per shard inside each replica group; Gemma's grouped-query scores are 6-D there)
    fit on 2x4 as on one device."""
    from test_fsdp_custom_layers import _hub_lm, assert_hub_fit_equals_one_device, hub_batch

    ref, lm = _hub_lm(family), _hub_lm(family)
    mesh = hsdp_mesh((2, 4))
    for block in lm.backbone.transformer_layers:
        fully_shard(block, mesh=mesh)
    fully_shard(lm, mesh=mesh)
    assert_hub_fit_equals_one_device(ref, lm, *hub_batch())


def test_held_gradients_are_refused_by_name_under_hsdp():
    """Gradient-sync off (FSDP2 and FSDP1's no_sync) and requires_all_reduce=False would hold each
    replica group's gradients: refused before anything changes; True stays allowed."""
    model = shard_mlp(make_mlp_16_32_8(), hsdp_mesh((2, 4)))
    for call in (lambda: model.set_requires_gradient_sync(False), lambda: model.set_requires_all_reduce(False)):
        with pytest.raises(NotImplementedError, match="under HSDP"):
            call()
    assert model._fsdp_state.grad_sync.enabled
    model.set_requires_gradient_sync(True)
    model.set_requires_all_reduce(True)
    fsdp1 = FullyShardedDataParallel(make_mlp_16_32_8(), device_mesh=hsdp_mesh((2, 4)),
                                     sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(NotImplementedError, match=r"no_sync\(\) under HSDP"):
        with fsdp1.no_sync():
            pass


def test_dropout_draws_one_devices_masks_in_every_replica_group(float64):
    """Each replica group draws the masks of its own rows (not group 0's), and the backward's second
    trace of a group's program replays the forward's seeds: the forward output and a fit with
    dropout equal one device's with the same draws (tfdist's mesh-invariant dropout)."""
    from keras_helpers import on_one_device
    from tfdist.keras._data import gather_to_numpy

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up"),
                                 keras.layers.Dropout(0.5), keras.layers.Dense(8, name="down")])

    ref, model = on_one_device(make()), shard_mlp(make(), hsdp_mesh((2, 4)))
    outputs = []
    for m in (ref, model):
        keras.utils.set_random_seed(1)
        outputs.append(gather_to_numpy(m(X[:16], training=True)))
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-12)
    assert np.abs(outputs[0][:8] - outputs[0][8:]).max() > 0.1  # the groups' rows differ
    losses = []
    for m in (ref, model):
        keras.utils.set_random_seed(2)
        losses.append(fit(m, X[:48], np.random.default_rng(1).standard_normal((48, 8)), "mse"))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-9)
    assert max_weight_diff(ref, model) < 1e-10
