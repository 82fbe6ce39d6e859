"""Batch-end callbacks one step behind on a model on a mesh (tfdist/keras/_callbacks.py).

References: Keras' own rule for when batch-end callbacks may run asynchronously
(``CallbackList._configure_async_dispatch`` on a backend that declares itself thread safe),
Keras' order of hooks for callbacks that watch batch ends, and the losses of the same
training on one device.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras.src.callbacks.callback_list import CallbackList

from keras_helpers import make_mlp, model_parallel, no_global_distribution  # noqa: F401
from tfdist.keras import _callbacks

X = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
Y = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)


class Events(keras.callbacks.Callback):
    """Records the hooks in the order they run, and each batch's loss."""

    def __init__(self, events: list, async_safe: bool, stop_at: int | None = None) -> None:
        super().__init__()
        self.events, self.async_safe, self.stop_at = events, async_safe, stop_at

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.events.append(("begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("end", batch, logs["loss"]))
        if batch == self.stop_at:
            self.model.stop_training = True

    def on_test_begin(self, logs=None):
        self.events.append(("test_begin",))

    def on_test_batch_begin(self, batch, logs=None):
        self.events.append(("test_batch_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.events.append(("test_end", batch, logs["loss"]))

    def on_test_end(self, logs=None):
        self.events.append(("test_done",))


def _fit(distribution, async_safe: bool, stop_at=None, **fit_kwargs):
    keras.distribution.set_distribution(distribution)
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    events: list = []
    model.fit(X, Y, batch_size=16, shuffle=False, verbose=0,
              callbacks=[Events(events, async_safe, stop_at)], **fit_kwargs)
    return model, events


def _order(events):
    return [e[:2] if len(e) > 1 else e for e in events]


def _losses(events, kind="end"):
    return [e[2] for e in events if e[0] == kind]


@pytest.mark.parametrize("distribution", [keras.distribution.DataParallel, model_parallel], ids=["dp", "2x4"])
def test_async_safe_batch_ends_run_after_the_next_dispatch_with_one_device_losses(distribution):
    _, one_device = _fit(None, async_safe=True, epochs=1)
    model, events = _fit(distribution(), async_safe=True, epochs=1)
    assert _order(one_device) == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("begin", 2),
                                  ("end", 2), ("begin", 3), ("end", 3), ("epoch_end", 0)]
    # step k+1 is dispatched (its begin hook has run) before step k's batch-end callbacks
    assert _order(events) == [("begin", 0), ("begin", 1), ("end", 0), ("begin", 2), ("end", 1),
                              ("begin", 3), ("end", 2), ("end", 3), ("epoch_end", 0)]
    np.testing.assert_allclose(_losses(events), _losses(one_device), rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_a_callback_that_watches_batch_ends_keeps_keras_order_and_stops_at_once():
    """Keras' rule: a batch-end hook without ``async_safe`` makes every batch end wait."""
    model, events = _fit(model_parallel(), async_safe=False, stop_at=1, epochs=1)
    assert _order(events) == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("epoch_end", 0)]
    assert int(model.optimizer.iterations.numpy()) == 2  # no step ran after the one that stopped


def test_an_async_safe_stop_takes_effect_one_step_later_as_on_keras_async_backends():
    model, events = _fit(model_parallel(), async_safe=True, stop_at=1, epochs=1)
    assert _order(events)[-2:] == [("end", 2), ("epoch_end", 0)]
    assert int(model.optimizer.iterations.numpy()) == 3


def test_validation_and_epoch_end_come_after_every_pending_batch_end():
    _, one_device = _fit(None, async_safe=True, epochs=2, validation_data=(X[:32], Y[:32]))
    _, events = _fit(model_parallel(), async_safe=True, epochs=2, validation_data=(X[:32], Y[:32]))
    train = [("begin", 0), ("begin", 1), ("end", 0), ("begin", 2), ("end", 1), ("begin", 3), ("end", 2),
             ("end", 3)]
    test = [("test_begin",), ("test_batch_begin", 0), ("test_batch_begin", 1), ("test_end", 0),
            ("test_end", 1), ("test_done",)]
    assert _order(events) == (train + test + [("epoch_end", 0)] + train + test + [("epoch_end", 1)])
    np.testing.assert_allclose(_losses(events), _losses(one_device), rtol=1e-5)
    np.testing.assert_allclose(_losses(events, "test_end"), _losses(one_device, "test_end"), rtol=1e-5)


def test_evaluate_alone_lags_its_batch_ends_too():
    keras.distribution.set_distribution(model_parallel())
    model = make_mlp()
    model.compile(optimizer="sgd", loss="mse")
    events: list = []
    result = model.evaluate(X, Y, batch_size=32, verbose=0, callbacks=[Events(events, async_safe=True)],
                            return_dict=True)
    assert _order(events) == [("test_begin",), ("test_batch_begin", 0), ("test_batch_begin", 1),
                              ("test_end", 0), ("test_end", 1), ("test_done",)]
    keras.distribution.set_distribution(None)
    reference = make_mlp()
    reference.compile(optimizer="sgd", loss="mse")
    assert result["loss"] == pytest.approx(reference.evaluate(X, Y, batch_size=32, verbose=0), rel=1e-5)


def test_models_off_a_mesh_keep_keras_callbacks_as_they_are():
    _, events = _fit(None, async_safe=True, epochs=1)
    assert _order(events)[:3] == [("begin", 0), ("end", 0), ("begin", 1)]
    assert type(CallbackList([], model=make_mlp())) is CallbackList


def _keras_async_rule(monkeypatch, callbacks) -> dict:
    """What Keras itself decides on a backend that declares itself thread safe."""
    monkeypatch.setattr(keras.src.backend, "IS_THREAD_SAFE", True)
    decided = CallbackList(callbacks)
    return {"train": decided._async_train, "test": decided._async_test}


class _TestEndOnly(keras.callbacks.Callback):
    def on_test_batch_end(self, batch, logs=None):
        pass


class _SafeBatchEnd(keras.callbacks.Callback):
    async_safe = True

    def on_train_batch_end(self, batch, logs=None):
        pass


@pytest.mark.parametrize("make", [
    lambda: [],
    lambda: [keras.callbacks.EarlyStopping(), keras.callbacks.History()],
    lambda: [keras.callbacks.TerminateOnNaN()],
    lambda: [keras.callbacks.ProgbarLogger()],
    lambda: [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr)],
    lambda: [_TestEndOnly()],
    lambda: [_SafeBatchEnd(), _TestEndOnly()],
    lambda: [Events([], async_safe=False)],
], ids=["none", "early_stopping", "terminate_on_nan", "progbar", "lr_scheduler", "test_end_only",
        "async_safe", "watches_batch_ends"])
def test_the_lag_rule_is_keras_own_async_rule(monkeypatch, make):
    callbacks = make()
    assert _callbacks.may_lag(callbacks) == _keras_async_rule(monkeypatch, callbacks)


def test_a_lagged_list_made_for_a_model_on_a_mesh():
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = make_mlp()
    assert type(CallbackList([], model=model)) is _callbacks.StepBehindCallbackList
    assert type(CallbackList([Events([], async_safe=False)], model=model)) is CallbackList
