"""Python-object collectives between clients for checkpoint planning.

Plans and write results are small Python objects; they travel through
TensorFlow's coordination service key-value store (the service multi-client
DTensor starts), not through device collectives, so that an ``async_save``
thread can finish a checkpoint while the training loop runs DTensor
collectives on the main thread.  Every client makes the same calls in the same
order, so a per-process sequence number names each exchange.
"""

from __future__ import annotations

import base64
import itertools
import pickle
import threading
from typing import Any

from tensorflow.python.eager import context

from tfdist import _runtime

_sequence = itertools.count()
_lock = threading.Lock()


class Group:
    """The clients taking part in one checkpoint operation (all of them, or this one with ``no_dist``)."""

    def __init__(self, no_dist: bool, timeout: float = 1800.0) -> None:
        self.distributed = (not no_dist) and _runtime.is_multi_client()
        self.rank = _runtime.get_rank() if self.distributed else 0
        self.world = _runtime.get_world_size() if self.distributed else 1
        self.timeout_ms = int(timeout * 1000)
        with _lock:
            self.tag = f"tfdist/checkpoint/{next(_sequence)}"
        self._step = itertools.count()

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _key(self, step: int, rank: int) -> str:
        return f"{self.tag}/{step}/{rank}"

    def _put(self, key: str, obj: Any) -> None:
        context.context().set_config_key_value(key, base64.b64encode(pickle.dumps(obj)).decode("ascii"))

    def _get(self, key: str) -> Any:
        raw = context.context().get_config_key_value(key, timeout_in_ms=self.timeout_ms)
        return pickle.loads(base64.b64decode(raw))

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        step = next(self._step)
        self._put(self._key(step, self.rank), obj)
        return [obj if r == self.rank else self._get(self._key(step, r)) for r in range(self.world)]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every client's ``obj`` on the coordinator (None elsewhere)."""
        if not self.distributed:
            return [obj]
        step = next(self._step)
        self._put(self._key(step, self.rank), obj)
        if not self.is_coordinator:
            return None
        return [obj if r == 0 else self._get(self._key(step, r)) for r in range(self.world)]

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every client."""
        if not self.distributed:
            return obj
        step = next(self._step)
        if self.is_coordinator:
            self._put(self._key(step, 0), obj)
            return obj
        return self._get(self._key(step, 0))

    def scatter(self, objs: list[Any] | None) -> Any:
        """Client ``r`` gets ``objs[r]`` from the coordinator."""
        if not self.distributed:
            return objs[0]
        return self.broadcast(objs)[self.rank]


class CheckpointError(RuntimeError):
    """A checkpoint step failed on some client; the message names the client and the cause."""


def check_all(group: Group, error: BaseException | None, what: str) -> None:
    """Raises on every client if ``what`` failed on any of them (so none commits a partial result)."""
    errors = group.all_gather(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if error is not None:
        raise error
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {msg}")
