"""FSDP1's optimizer-state family: full, sharded, shard/scatter/flatten, rekey.

Reference: a plain Keras model (no FSDP) trained the same way; its optimizer's own slots
(``optimizer._momentums[i]``, ``_velocities[i]`` for ``trainable_variables[i]``) are what every
form must hold, and a model loaded from a converted dict must keep training like it.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from keras_helpers import DenseAdam, float64, no_global_distribution  # noqa: F401
from tfdist.fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType
from tfdist.models import GPT
from tfdist.tensor import DTensor, Shard

pytestmark = pytest.mark.usefixtures("float64")

RNG = np.random.default_rng(4)
V, S = 32, 8
IDS = RNG.integers(0, V, (32, S))
NEXT = RNG.integers(0, V, (32, S))
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_gpt():
    keras.utils.set_random_seed(0)
    model = GPT(V, S, dim=16, heads=4, depth=1)
    model(IDS[:1])
    return model


def train(model, batches=2):
    model.compile(optimizer=DenseAdam(1e-2), loss=SCE)
    return model.fit(IDS[:16 * batches], NEXT[:16 * batches], batch_size=16, epochs=1, verbose=0,
                     shuffle=False).history["loss"]


def mesh(n):
    return tfdist.DeviceMesh("cpu", list(range(n)), mesh_dim_names=("dp",))


@pytest.fixture(scope="module")
def trained():
    """(plain reference, FSDP over 8 devices), both after the same two Adam steps."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        ref = make_gpt()
        train(ref)
        model = FSDP(make_gpt(), device_mesh=mesh(8))
        train(model)
        yield ref, model
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def reference_slots(ref):
    """Parameter index -> {slot: numpy}, from Keras' own lists."""
    opt = ref.optimizer
    return {i: {"momentum": opt._momentums[i].numpy(), "velocity": opt._velocities[i].numpy()}
            for i in range(len(ref.trainable_variables))}


def assert_state_equals_reference(osd_by_id, ref):
    want = reference_slots(ref)
    assert set(osd_by_id["state"]) == set(want)
    for i, slots in want.items():
        for slot, value in slots.items():
            got = osd_by_id["state"][i][slot]
            got = got.full_tensor().numpy() if isinstance(got, DTensor) else np.asarray(got)
            np.testing.assert_allclose(got, value, atol=1e-12, err_msg=f"{i}/{slot}")


def test_full_optim_state_dict_is_the_whole_state_by_name(trained):
    ref, model = trained
    full = FSDP.full_optim_state_dict(model, model.optimizer)
    assert "blocks.0.mlp.up.kernel" in full["state"]
    assert all(isinstance(v, np.ndarray) for per in full["state"].values() for v in per.values())
    assert set(full["param_groups"][0]["params"]) == set(full["state"])
    by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model)
    assert_state_equals_reference(by_id, ref)


def test_rekey_round_trips_and_follows_trainable_variables_order(trained):
    ref, model = trained
    full = FSDP.full_optim_state_dict(model, model.optimizer)
    by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model)
    assert sorted(by_id["state"]) == list(range(len(model.trainable_variables)))
    for i, variable in enumerate(model.trainable_variables):
        assert by_id["state"][i]["momentum"].shape == tuple(variable.shape)
    assert sorted(by_id["param_groups"][0]["params"]) == sorted(by_id["state"])
    back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    assert set(back["state"]) == set(full["state"])
    for name in full["state"]:
        np.testing.assert_array_equal(back["state"][name]["velocity"], full["state"][name]["velocity"])


def test_sharded_optim_state_dict_holds_dtensors_as_the_slots_are_laid_out(trained):
    ref, model = trained
    sharded = FSDP.sharded_optim_state_dict(model, model.optimizer)
    value = sharded["state"]["blocks.0.mlp.up.kernel"]["momentum"]
    assert isinstance(value, DTensor) and value.placements == (Shard(0),)
    assert_state_equals_reference(FSDP.rekey_optim_state_dict(sharded, OptimStateKeyType.PARAM_ID, model), ref)


@pytest.mark.parametrize("route", ["shard_full", "scatter_full", "flatten_sharded"])
def test_state_moves_to_a_model_on_another_mesh_and_trains_on_like_the_reference(trained, route):
    """Saved on 8 devices, loaded on 4 (torch: 'a new model with a different world size'); one more
    step of both the loaded model and the reference gives the same loss and weights."""
    ref, model = trained
    new = FSDP(make_gpt(), device_mesh=mesh(4))
    new.compile(optimizer=DenseAdam(1e-2), loss=SCE)
    new.set_weights(model.get_weights())
    new.optimizer.build(new.trainable_variables)
    if route == "shard_full":
        osd = FSDP.shard_full_optim_state_dict(FSDP.full_optim_state_dict(model, model.optimizer), new)
    elif route == "scatter_full":
        osd = FSDP.scatter_full_optim_state_dict(FSDP.full_optim_state_dict(model, model.optimizer), new)
    else:
        osd = FSDP.flatten_sharded_optim_state_dict(
            FSDP.sharded_optim_state_dict(model, model.optimizer), new, new.optimizer)
    value = osd["state"]["blocks.0.mlp.up.kernel"]["velocity"]
    assert isinstance(value, DTensor) and value.device_mesh.size() == 4 and value.placements == (Shard(0),)
    FSDP.optim_state_dict_to_load(new, new.optimizer, osd)
    new.optimizer.iterations.assign(ref.optimizer.iterations)
    assert_state_equals_reference(
        FSDP.rekey_optim_state_dict(FSDP.full_optim_state_dict(new, new.optimizer), OptimStateKeyType.PARAM_ID,
                                    new), ref)
    step = slice(32 - 16, 32)
    want = ref.train_on_batch(IDS[step], NEXT[step])
    got = new.train_on_batch(IDS[step], NEXT[step])
    np.testing.assert_allclose(got, want, rtol=1e-10)
    for a, b in zip(ref.get_weights(), new.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-10)
    # the reference moved on: put it back for the next parametrisation
    ref.set_weights(model.get_weights())
    for i, slots in enumerate(reference_slots_of(model)):
        ref.optimizer._momentums[i].assign(slots["momentum"])
        ref.optimizer._velocities[i].assign(slots["velocity"])
    ref.optimizer.iterations.assign(model.optimizer.iterations)


def reference_slots_of(model):
    by_id = FSDP.rekey_optim_state_dict(FSDP.full_optim_state_dict(model, model.optimizer),
                                        OptimStateKeyType.PARAM_ID, model)
    return [by_id["state"][i] for i in range(len(model.trainable_variables))]


# -- bad input ------------------------------------------------------------------------------------

def test_bad_input_is_refused_naming_what_is_wrong(trained):
    ref, model = trained
    full = FSDP.full_optim_state_dict(model, model.optimizer)
    by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model)
    with pytest.raises(ValueError, match="group"):
        FSDP.full_optim_state_dict(model, model.optimizer, group="world")
    with pytest.raises(ValueError, match="rekey"):
        FSDP.shard_full_optim_state_dict(by_id, model)
    with pytest.raises(ValueError, match="optimizer state dict"):
        FSDP.shard_full_optim_state_dict({"blocks.0.mlp.up.kernel": 1}, model)
    with pytest.raises(ValueError, match="optim_state_key_type"):
        FSDP.rekey_optim_state_dict(full, "PARAM_ID", model)
    with pytest.raises(KeyError, match="not a parameter"):
        FSDP.shard_full_optim_state_dict({"state": {"nope.kernel": {}}, "param_groups": []}, model)
    bad = {"state": {"blocks.0.mlp.up.kernel": {"momentum": np.zeros((3, 3))}}, "param_groups": []}
    with pytest.raises(ValueError, match="momentum"):
        FSDP.shard_full_optim_state_dict(bad, model, optim=model.optimizer)
    # a valid call in the same process
    assert set(FSDP.shard_full_optim_state_dict(full, model)["state"]) == set(full["state"])
