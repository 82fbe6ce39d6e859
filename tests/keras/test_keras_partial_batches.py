"""Any batch size: the last partial batch of fit/evaluate/predict on a data-parallel mesh.

A batch that does not split over the data-parallel dim is computed whole by
every replica: its loss, metrics and gradients are exactly one device's.
Reference: the same model and data on one device (float64).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from keras_helpers import DenseAdam, float64, make_mlp, max_weight_diff, model_parallel  # noqa: F401
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.models import GPT, parallelize_gpt
from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

pytestmark = pytest.mark.usefixtures("float64")
RNG = np.random.default_rng(13)
X = RNG.standard_normal((51, 16))  # 51 = 3 batches of 16 + a partial batch of 3
Y = RNG.standard_normal((51, 8))


def compiled(model):
    model.compile(optimizer=DenseAdam(1e-2), loss="mse", metrics=["mae"])
    return model


def tp_mlp():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    return compiled(parallelize_module(make_mlp(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}))


def fit(model, **kwargs):
    return model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0, **kwargs).history


def test_fit_with_a_partial_last_batch_equals_one_device():
    ref = compiled(make_mlp())
    want = fit(ref)
    model = tp_mlp()
    got = fit(model)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9)
    assert max_weight_diff(ref, model) < 1e-9


def test_validation_split_evaluate_and_predict_with_partial_batches():
    ref = compiled(make_mlp())
    want = fit(ref, validation_split=0.1)  # 45 train (last batch 13), 6 validation
    model = tp_mlp()
    got = fit(model, validation_split=0.1)
    for key in ("loss", "val_loss", "val_mae"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9)
    np.testing.assert_allclose(model.evaluate(X[:7], Y[:7], batch_size=4, verbose=0),
                               ref.evaluate(X[:7], Y[:7], batch_size=4, verbose=0), rtol=1e-9)
    np.testing.assert_allclose(model.predict(X[:1], verbose=0), ref.predict(X[:1], verbose=0), atol=1e-12)
    np.testing.assert_allclose(model.predict(X, batch_size=16, verbose=0), ref.predict(X, verbose=0), atol=1e-12)
    np.testing.assert_allclose(np.asarray(tfdist.keras._data.gather_to_numpy(model(X[:3]))), ref(X[:3]).numpy(),
                               atol=1e-12)


def test_layout_map_distribution_with_a_partial_last_batch():
    ref = compiled(make_mlp())
    want = fit(ref)
    keras.distribution.set_distribution(model_parallel((2, 4)))
    model = compiled(make_mlp())
    np.testing.assert_allclose(fit(model)["loss"], want["loss"], rtol=1e-9)
    assert max_weight_diff(ref, model) < 1e-9


def test_gpt_sequence_parallel_with_a_partial_last_batch():
    rng = np.random.default_rng(3)
    ids, nxt = rng.integers(0, 32, (13, 8)), rng.integers(0, 32, (13, 8))  # batches of 4, last of 1

    def make():
        keras.utils.set_random_seed(0)
        model = GPT(32, 8, dim=16, heads=4, depth=1)
        model(ids[:1])
        model.compile(optimizer=DenseAdam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ref = make()
    want = ref.fit(ids, nxt, batch_size=4, shuffle=False, verbose=0).history["loss"]
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(make(), mesh, sequence_parallel=True)
    np.testing.assert_allclose(model.fit(ids, nxt, batch_size=4, shuffle=False, verbose=0).history["loss"], want,
                               rtol=1e-9)
    assert max_weight_diff(ref, model) < 1e-9
