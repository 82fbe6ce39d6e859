"""keras.distribution.DataParallel on devices that share a host's CPU: the optimizer state of
large parameters is sharded over the batch dim (ZeRO stage 1), and training is still exactly
one device's.  Reference: the same model, data and optimizer in Keras on one device."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfdist.keras  # noqa: F401  (the Keras plug-in)
from keras_helpers import max_weight_diff, model_parallel, no_global_distribution  # noqa: F401
from tfdist.keras import _optimizer

RNG = np.random.default_rng(5)
X = RNG.standard_normal((64, 16)).astype("float32")
Y = RNG.standard_normal((64, 8)).astype("float32")
WIDE = 512  # the 512 x 512 kernel has 2**18 elements: the smallest that gets sharded state


def _wide_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(WIDE, activation="relu", name="up"),
                             keras.layers.Dense(WIDE, activation="relu", name="mid"),
                             keras.layers.Dense(8, name="down")])


def _train(distribution):
    keras.distribution.set_distribution(distribution)
    model = _wide_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    history = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return model, history.history["loss"]


def _local_numel(variable) -> int:
    return int(np.prod(dtensor.unpack(variable._value.read_value())[0].shape))


def test_large_parameters_have_their_state_sharded_and_train_like_one_device():
    ref, ref_loss = _train(None)
    model, loss = _train(keras.distribution.DataParallel())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert max_weight_diff(ref, model) < 1e-5
    slots = {v.path: v for v in model.optimizer.variables if len(v.shape)}
    big = [p for p in slots if "mid_kernel" in p]
    assert len(big) == 2  # Adam's two moments of the 512 x 512 kernel
    for path, slot in slots.items():
        numel = int(np.prod(slot.shape))
        assert _local_numel(slot) == (numel // 8 if path in big else numel), path
    for weight in model.trainable_variables:  # the parameters stay whole: data parallel
        assert _local_numel(weight) == int(np.prod(weight.shape))


def test_the_state_keeps_keras_layout_elsewhere():
    """Model parallel, GPU meshes and CPU meshes of one device per client keep the parameter's layout."""
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    cpus = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
    shared = dtensor.Mesh(["batch"], np.arange(8), list(range(8)), cpus)
    assert _optimizer._shared_host_slot_layout(dtensor.Layout.replicated(shared, 2)) is not None
    gpus = [d.replace("CPU", "GPU") for d in cpus]
    on_gpus = dtensor.Mesh(["batch"], np.arange(8), list(range(8)), gpus)
    assert _optimizer._shared_host_slot_layout(dtensor.Layout.replicated(on_gpus, 2)) is None
    one_per_client = dtensor.Mesh(["batch"], np.arange(8), [3], [cpus[3]], global_devices=cpus)
    assert _optimizer._shared_host_slot_layout(dtensor.Layout.replicated(one_per_client, 2)) is None
    keras.distribution.set_distribution(model_parallel((2, 4)))
    assert _optimizer._shared_host_slot_layout(dtensor.Layout.replicated(shared, 2)) is None


@pytest.mark.parametrize("numel,sharded", [((1 << 18) - 8, False), (1 << 18, True)])
def test_the_size_from_which_state_is_sharded(numel, sharded):
    """Both sizes divide over 8 devices: only the floor of 2**18 elements decides."""
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    mesh = dtensor.create_mesh([("batch", 8)], devices=[f"CPU:{i}" for i in range(8)])
    param = dtensor.Layout.replicated(mesh, 1)
    slot = _optimizer._shared_host_slot_layout(param)(param, (numel,))
    assert slot.sharding_specs == (["batch"] if sharded else [dtensor.UNSHARDED])
