"""Batch-end callbacks one step behind the devices, where Keras itself would let them lag.

Keras 3 runs ``on_train_batch_end``/``on_test_batch_end`` on a thread pool, so that the
next step is dispatched while the callbacks convert this step's logs, when two things hold:
the backend is thread safe, and no callback the user passed overrides a batch-end hook
without declaring ``async_safe = True`` (``CallbackList._configure_async_dispatch``).  On
TensorFlow the first never holds (``IS_THREAD_SAFE = False``), so every step waits for its
logs before the next is dispatched and the devices idle while Python dispatches it.

For a model on a mesh, tfdist gives the same overlap without a thread: where Keras' rule
would allow async callbacks, the batch-end callbacks of step k run right after step k+1 has
been dispatched, on the main thread, and every other hook (epoch end, validation, train
end...) first runs what is pending.  Callbacks see the same batches, logs and order of
batch-end calls as before; what lags is only what Keras lets lag on JAX: a batch-begin hook
of step k+1 runs before the batch-end hooks of step k, and ``stop_training`` set by an
``async_safe`` batch-end callback takes effect one step later.
"""

from __future__ import annotations

from typing import Any, Callable

from keras import tree
from keras.callbacks import CallbackList

from tfdist import _patches
from tfdist.keras._keras_internals import is_default
from tfdist.keras._trainer import is_distributed

__all__ = ["may_lag", "StepBehindCallbackList", "install"]

_INIT = "keras.src.callbacks.callback_list:CallbackList.__init__"


def may_lag(callbacks: Any) -> dict[str, bool]:
    """Keras' own rule for async batch-end callbacks: per mode, whether no callback the user
    passed watches batch ends, except those that declare ``async_safe``."""
    modes = {"train": True, "test": True}
    for callback in tree.flatten(callbacks) if callbacks else []:
        if getattr(callback, "async_safe", False):
            continue
        if not (is_default(callback.on_batch_end) and is_default(callback.on_train_batch_end)):
            modes["train"] = False
        if not is_default(callback.on_test_batch_end):
            modes["test"] = False
    return modes


def _waits_first(name: str) -> Callable[..., Any]:
    hook = getattr(CallbackList, name)

    def run(self, *args, **kwargs):
        self.run_pending()
        return hook(self, *args, **kwargs)

    run.__name__ = name
    run.__doc__ = f"``CallbackList.{name}``, after the pending batch-end callbacks."
    return run


class StepBehindCallbackList(CallbackList):
    """A ``CallbackList`` whose batch-end callbacks run after the next step is dispatched.

    Only made by ``CallbackList(..., model=m)`` for a model ``m`` on a mesh, when
    :func:`may_lag` allows it.  At most one step's callbacks are pending.
    """

    _lags: dict[str, bool]
    _pending: tuple[Callable[..., Any], int, Any] | None

    def run_pending(self) -> None:
        """Runs the batch-end callbacks still waiting, if any."""
        if self._pending is not None:
            hook, batch, logs = self._pending
            self._pending = None
            hook(batch, logs)

    def _lag(self, mode: str, hook: Callable[..., Any], batch: int, logs: Any) -> None:
        self.run_pending()  # step ``batch`` is dispatched: the previous step's logs are due
        if self._lags[mode]:
            self._pending = (hook, batch, logs)
        else:
            hook(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._lag("train", self._on_train_batch_end, batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._lag("test", self._on_test_batch_end, batch, logs)


# every other hook but the batch-begin ones (which run before the dispatch they would
# otherwise hold up) runs the pending callbacks first, so their order is kept
for _name in ("on_batch_begin", "on_batch_end", "on_epoch_begin", "on_epoch_end",
              "on_train_begin", "on_train_end", "on_test_begin", "on_test_end",
              "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end"):
    setattr(StepBehindCallbackList, _name, _waits_first(_name))
del _name


def install() -> None:
    """``CallbackList(..., model=m)`` for a model on a mesh lags where Keras' rule allows."""
    original = _patches.original(_INIT)

    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None, **params):
        original(self, callbacks, add_history=add_history, add_progbar=add_progbar, model=model, **params)
        if type(self) is not CallbackList or model is None or not is_distributed(model):
            return
        lags = may_lag(callbacks)
        if any(lags.values()):
            self.__class__ = StepBehindCallbackList
            self._lags, self._pending = lags, None

    _patches.install(_INIT, __init__)
