"""The persistent writer process of ``async_save(async_checkpointer_type=PROCESS)``.

torch's PROCESS checkpointer hands the staged state dict to a long-lived background process that
serialises and writes it, so the training process spends no time (and no GIL) on serialisation.
tfdist keeps planning, the exchanges between clients (TF's coordination service, which only the
training process belongs to) and the commit in the training process's writing thread; what the child
does is the heavy part, writing this client's tensor bundles (``SaveV2``).  A TF tensor cannot cross
a process boundary, so each chunk goes over as a numpy copy (of the staged snapshot, in the writing
thread, not in the training step).  One child serves every PROCESS save of this client; it starts with
the first one and stops with the training process.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
import traceback
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["write_bundle", "writer_pid"]

_CHILD_ENV = {"CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2", "TFDIST_VIRTUAL_CPUS": "0"}
_lock = threading.Lock()
_child: dict[str, Any] = {}


def _serve(conn) -> None:
    """The child: writes each bundle it is sent, answers ("ok", None) or ("error", traceback)."""
    import tensorflow as child_tf

    while True:
        request = conn.recv()
        if request is None:
            return
        prefix, names, slices, arrays = request
        try:
            with child_tf.device("CPU:0"):
                child_tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=slices,
                                        tensors=[child_tf.constant(a) for a in arrays])
            conn.send(("ok", None))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it from the save
            conn.send(("error", traceback.format_exc()))


def _connection():
    if _child.get("process") is None or not _child["process"].is_alive():
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child,), daemon=True, name="tfdist-checkpoint-writer")
        # the child inherits the environment at start: it needs no accelerator (TF would reserve GPU
        # memory at its first op) and no place in a multi-client job
        saved = {k: os.environ.get(k) for k in _CHILD_ENV}
        os.environ.update(_CHILD_ENV)
        try:
            process.start()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        _child.update(process=process, conn=parent)
    return _child["conn"]


def write_bundle(prefix: str, names: list[str], slices: list[str], tensors: list[tf.Tensor]) -> None:
    """Writes one bundle in the writer process (the same files ``_tf_io.write_bundle`` writes)."""
    arrays = [np.asarray(t.numpy()) for t in tensors]
    with _lock:
        conn = _connection()
        conn.send((prefix, names, slices, arrays))
        status, detail = conn.recv()
    if status != "ok":
        raise RuntimeError(f"async_save: the checkpoint writer process failed to write {prefix}:\n{detail}")


def writer_pid() -> int | None:
    """The writer process's id (None before the first PROCESS save)."""
    process = _child.get("process")
    return process.pid if process is not None and process.is_alive() else None


@atexit.register
def _stop() -> None:
    if _child.get("process") is not None and _child["process"].is_alive():
        try:
            _child["conn"].send(None)
            _child["process"].join(timeout=10)
        except (OSError, EOFError, BrokenPipeError):
            pass
