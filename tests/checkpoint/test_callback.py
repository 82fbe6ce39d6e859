"""tfdist.keras.DistributedCheckpoint: periodic saves, keep-last-K, and a resumed fit that matches an
uninterrupted one (same losses, same weights)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
import tfdist.keras  # noqa: F401
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.fsdp import fully_shard
from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

RNG = np.random.default_rng(2)
X = RNG.standard_normal((64, 16)).astype("float32")
Y = RNG.standard_normal((64, 4)).astype("float32")


def make(seed, kind):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dropout(0.3, name="drop"), keras.layers.Dense(4, name="down"),
    ])
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    if kind == "tp":
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    elif kind == "fsdp":
        fully_shard(model, mesh=tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",)))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def fit(model, epochs, callbacks=()):
    return model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks)).history["loss"]


@pytest.mark.parametrize("kind,async_save", [("tp", False), ("fsdp", True), ("plain", False)])
def test_resumed_fit_continues_like_an_uninterrupted_one(tmp_path, kind, async_save):
    reference = make(0, kind)
    want = fit(reference, 4)
    first = make(0, kind)
    fit(first, 2, [tfdist.keras.DistributedCheckpoint(tmp_path, async_save=async_save)])
    # a new process would build the model again, differently initialised: the checkpoint decides
    resumed = make(123, kind)
    callback = tfdist.keras.DistributedCheckpoint(tmp_path, async_save=async_save)
    got = fit(resumed, 4, [callback])
    assert callback.restored_from.name == "step-000000008"  # 2 epochs of 4 steps
    np.testing.assert_allclose(got, want[2:], rtol=1e-5)
    for a, b in zip(reference.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_step_frequency_keeps_the_newest_k(tmp_path):
    model = make(0, "tp")
    callback = tfdist.keras.DistributedCheckpoint(tmp_path, save_freq=3, keep=2)
    fit(model, 2, [callback])  # steps 3, 4 (epoch end), 6, 8 (epoch end): the newest two stay
    assert [p.name for p in callback.checkpoints()] == ["step-000000006", "step-000000008"]
    other = make(5, "tp")
    cb = tfdist.keras.DistributedCheckpoint(tmp_path)
    cb.set_model(other)
    progress = cb.restore(tmp_path / "step-000000006")
    assert progress == {"epoch": 1, "epoch_end": False}
    assert int(other.optimizer.iterations.numpy()) == 6


def test_bad_arguments():
    with pytest.raises(ValueError, match="save_freq"):
        tfdist.keras.DistributedCheckpoint("/tmp/x", save_freq=0)
    with pytest.raises(ValueError, match="keep"):
        tfdist.keras.DistributedCheckpoint("/tmp/x", keep=0)
