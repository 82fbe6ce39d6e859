"""DistributedCheckpoint: a Keras callback that saves tfdist checkpoints during fit and resumes from them.

Each save is one tfdist checkpoint directory ``<directory>/step-<global step>``
holding the model's weights (canonical names, sharded as they are), the
optimizer's slots and step counter, every random-generator state of the model
(dropout seeds) and Keras's global seed generator, and the progress (epoch,
step).  ``fit`` with the callback resumes from the newest checkpoint written
at the end of an epoch: Keras restarts ``fit`` at an epoch boundary (as its own
``BackupAndRestore`` does), so a checkpoint taken mid-epoch cannot resume
``fit`` without replaying part of an epoch; it can be restored explicitly with
:meth:`DistributedCheckpoint.restore`.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
from concurrent.futures import Future
from typing import Any

import keras

import tfdist.checkpoint as dcp
from tfdist import _runtime
from tfdist.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from tfdist.keras._keras_internals import global_state
from tfdist.tensor._modules import module_backend

_NAME = re.compile(r"^step-(\d{9})$")


def _seed_generators(model: Any) -> dict[str, Any]:
    """Random-generator state variables by layer path (Keras numbers its generators per process, so
    their variable paths differ between runs; the layer paths do not), and Keras's global one."""
    out = {}
    for path, layer in module_backend(model, "DistributedCheckpoint").named_layers(model):
        for i, generator in enumerate(getattr(layer, "_seed_generators", []) or []):
            out[f"{path or 'model'}.seed_generator_{i}"] = generator.state
    generator = global_state.get_global_attribute("global_seed_generator")
    if generator is not None:
        out["global"] = generator.state
    return out


class DistributedCheckpoint(keras.callbacks.Callback):
    """Saves a tfdist checkpoint every ``save_freq`` steps or every epoch; resumes ``fit`` from the newest.

    Args:
        directory: where the checkpoints go (``step-000000120`` etc.; on a
            filesystem every client sees).
        save_freq: ``"epoch"`` or a number of training steps (a checkpoint is
            also written at each epoch end: the points ``fit`` resumes from).
        keep: how many of the newest checkpoints to keep (older ones are deleted).
        async_save: write with ``tfdist.checkpoint.async_save`` (training goes
            on while the files are written).
        resume: at ``on_train_begin``, load the newest epoch-end checkpoint and
            start ``fit`` at the epoch after it.

    Example::

        ckpt = tfdist.keras.DistributedCheckpoint("/tmp/run1", save_freq="epoch", keep=2)
        model.fit(x, y, epochs=10, callbacks=[ckpt])    # run again after a crash: continues
    """

    def __init__(self, directory: str | os.PathLike, save_freq: str | int = "epoch", keep: int = 3,
                 async_save: bool = False, resume: bool = True) -> None:
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"save_freq must be 'epoch' or a positive int. Received: save_freq={save_freq!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive int. Received: keep={keep!r}")
        self.directory = pathlib.Path(os.fspath(directory))
        self.save_freq, self.keep, self.async_save, self.resume = save_freq, keep, async_save, resume
        self._pending: Future | None = None
        self._epoch = 0
        self.restored_from: pathlib.Path | None = None

    # -- what is saved -------------------------------------------------------------------
    def _state(self, epoch_end: bool) -> dict[str, Any]:
        model = self.model
        state = {"model": get_model_state_dict(model), "rng": _seed_generators(model),
                 "progress": {"epoch": self._epoch, "epoch_end": epoch_end}}
        if getattr(model, "optimizer", None) is not None:
            state["optim"] = get_optimizer_state_dict(model, model.optimizer)
        return state

    def _step(self) -> int:
        optimizer = getattr(self.model, "optimizer", None)
        return int(optimizer.iterations.numpy()) if optimizer is not None else 0

    def _save(self, epoch_end: bool) -> None:
        self._wait()
        path = self.directory / f"step-{self._step():09d}"
        if epoch_end is False and (path / ".metadata").exists():
            return
        if self.async_save:
            self._pending = dcp.async_save(self._state(epoch_end), checkpoint_id=path)
        else:
            dcp.save(self._state(epoch_end), checkpoint_id=path)
            self._prune()

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
            self._prune()

    def _prune(self) -> None:
        if _runtime.get_rank() != 0:
            return
        done = self.checkpoints()
        for old in done[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        newest = done[-1] if done else None
        for entry in self.directory.iterdir():  # saves that never finished, older than the newest
            if _NAME.match(entry.name) and not (entry / ".metadata").exists() and newest and entry < newest:
                shutil.rmtree(entry, ignore_errors=True)

    # -- finding and restoring ---------------------------------------------------------------
    def checkpoints(self) -> list[pathlib.Path]:
        """Complete checkpoints in ``directory``, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name) and (p / ".metadata").is_file())

    def restore(self, path: str | os.PathLike | None = None, *, epoch_end_only: bool = False) -> dict | None:
        """Loads a checkpoint (the newest if ``path`` is None) into the model and its optimizer.

        Returns its progress ``{"epoch", "epoch_end"}``, or None if there is none.
        """
        candidates = [pathlib.Path(path)] if path is not None else list(reversed(self.checkpoints()))
        for candidate in candidates:
            state = self._state(epoch_end=False)
            if epoch_end_only:
                progress = {"progress": {"epoch": 0, "epoch_end": False}}
                dcp.load(progress, checkpoint_id=candidate)
                if not progress["progress"]["epoch_end"]:
                    continue
            dcp.load(state, checkpoint_id=candidate)
            set_model_state_dict(self.model, state["model"])
            if "optim" in state:
                set_optimizer_state_dict(self.model, self.model.optimizer, state["optim"])
            self.restored_from = candidate
            return state["progress"]
        return None

    # -- Keras hooks ---------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.resume:
            progress = self.restore(epoch_end_only=True)
            if progress is not None:
                self._epoch = progress["epoch"]
                self.model._initial_epoch = progress["epoch"]

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if isinstance(self.save_freq, int) and self._step() % self.save_freq == 0:
            self._save(epoch_end=False)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch + 1
        self._save(epoch_end=True)  # with a step frequency too: the points fit can resume from

    def on_train_end(self, logs: dict | None = None) -> None:
        self._wait()
        self.model._initial_epoch = None  # a later fit of this model starts where it is asked to
