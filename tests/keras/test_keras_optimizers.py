"""Every Keras optimizer trains a model-parallel model exactly as on one device.

10 fit steps of a 2-layer MLP with a LayoutMap on 2x4 and 4x2 meshes
(batch x model), and under DataParallel on 8 with the optimizer state sharded,
against the same model, data and optimizer on one device.
Keras' optimizers read their slots right after writing them, which TF
DTensor serves stale on 2-D meshes (docs/tf_dtensor_repros/dtensor_stale_read_after_write.py):
each optimizer exercises tfdist's read-after-write fix in its own way.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfdist.keras  # noqa: F401
from tfdist.keras import _optimizer
from keras_helpers import make_mlp, max_weight_diff, model_parallel, no_global_distribution  # noqa: F401

RNG = np.random.default_rng(1)
X = RNG.standard_normal((80, 16)).astype("float32")
Y = RNG.standard_normal((80, 8)).astype("float32")

OPTIMIZERS = {
    "SGD-momentum-nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "Adam": lambda: keras.optimizers.Adam(0.01),
    "AdamW": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Adamax": lambda: keras.optimizers.Adamax(0.01),
    "Nadam": lambda: keras.optimizers.Nadam(0.01),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
    "Lion": lambda: keras.optimizers.Lion(0.001),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "Lamb": lambda: keras.optimizers.Lamb(0.01),
}
if hasattr(keras.optimizers, "Muon"):
    OPTIMIZERS["Muon"] = lambda: keras.optimizers.Muon(0.01)


def train(optimizer):
    model = make_mlp()
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # 10 steps
    return model, history.history["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), "data_parallel_sharded_state"], ids=str)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_one_device(name, mesh_shape, monkeypatch):
    keras.distribution.set_distribution(None)
    ref, ref_loss = train(OPTIMIZERS[name]())
    if mesh_shape == "data_parallel_sharded_state":
        # DataParallel on 8 virtual CPUs shards the state of large parameters over the batch
        # dim (tfdist/keras/_optimizer.py); with no size floor every slot of the MLP that
        # divides is sharded, so each optimizer's update runs on state shards
        monkeypatch.setattr(_optimizer, "SHARDED_SLOT_MIN_ELEMENTS", 0)
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    else:
        keras.distribution.set_distribution(model_parallel(mesh_shape))
    model, loss = train(OPTIMIZERS[name]())
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    assert max_weight_diff(ref, model) < 2e-5
    if mesh_shape == "data_parallel_sharded_state":
        local = [dtensor.unpack(v._value.read_value())[0].shape.num_elements() for v in model.optimizer.variables]
        assert any(n * 8 == int(np.prod(v.shape)) for n, v in zip(local, model.optimizer.variables) if len(v.shape))
