"""Staging for async_save (torch.distributed.checkpoint.staging): AsyncStager, BlockingAsyncStager.

``async_save`` first *stages* the state dict -- takes a snapshot that later training steps cannot
change -- then writes the snapshot in a thread.  A stager decides how: :class:`BlockingAsyncStager`
(the default, and what ``FileSystemWriter.stage`` does) reads every variable once and keeps the
values, copying chunks that live on GPU/TPU to host memory; a TF tensor is immutable, so the snapshot
is the read.  Write your own by subclassing :class:`AsyncStager` (e.g. staging that overlaps the next
forward pass, finished by ``synchronize_staging``).
"""

from __future__ import annotations

import pickle
from typing import Any

from tfdist.checkpoint import _values
from tfdist.checkpoint.stateful import stateful_values

__all__ = ["AsyncStager", "BlockingAsyncStager", "stage_state_dict"]


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)) and not _values.is_tensor_like(value):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _stage_tree(value: Any, read: dict[int, Any]) -> Any:
    if isinstance(value, dict):
        return {k: _stage_tree(v, read) for k, v in value.items()}
    if isinstance(value, list) and not _values.is_tensor_like(value):
        return [_stage_tree(v, read) for v in value]
    if isinstance(value, tuple) and not _values.is_tensor_like(value):
        return tuple(_stage_tree(v, read) for v in value)
    return _values.stage(value, read.get(id(value)))


def stage_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of ``state_dict`` (Stateful objects read through ``state_dict()``) that later updates of
    the model do not change: every variable read once, chunks on accelerators copied to host memory."""
    state = stateful_values(state_dict)
    values = _values.read_variables(_leaves(state))
    return {k: _stage_tree(v, values) for k, v in state.items()}


class AsyncStager:
    """torch's staging protocol for :func:`tfdist.checkpoint.async_save`.

    ``async_save`` calls :meth:`stage`, starts writing what it returned in a thread, then -- if
    :attr:`should_synchronize_after_execute` -- calls :meth:`synchronize_staging` before returning.
    A stager whose staging runs on after :meth:`stage` returns sets ``_synchronize_after_execute`` to
    False and lets the user call :meth:`synchronize_staging` before changing the model.

    Example::

        class CountingStager(AsyncStager):
            def stage(self, state_dict):
                self.calls = getattr(self, "calls", 0) + 1
                return stage_state_dict(state_dict)

        tfdist.checkpoint.async_save(sd, checkpoint_id=path, async_stager=CountingStager()).result()
    """

    _synchronize_after_execute: bool = True

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Whether ``async_save`` calls :meth:`synchronize_staging` once the write has started."""
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` that no update after this call changes."""
        raise NotImplementedError(f"{type(self).__name__}.stage must return a staged copy of the state dict.")

    def synchronize_staging(self) -> None:
        """Waits until staging is complete (after it the original state dict may change)."""

    def close(self) -> None:
        """Releases what the stager holds."""


class BlockingAsyncStager(AsyncStager):
    """Stages to host memory and returns when the copy is complete (``synchronize_staging`` is a no-op).

    Args:
        cache_staged_state_dict: torch keeps its pinned CPU buffers between saves; TF tensors are
            immutable and TF owns their host memory, so each stage holds fresh values and nothing is
            cached (accepted, no effect on values).
        type_check: check that every non-tensor value can be serialised (pickled) while staging, so a
            bad value is named before the write starts.
    """

    _synchronize_after_execute = False

    def __init__(self, cache_staged_state_dict: bool = False, type_check: bool = False) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = stage_state_dict(state_dict)
        if self.type_check:
            _check_serialisable(staged, "")
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returned a complete copy."""


def _check_serialisable(value: Any, key: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _check_serialisable(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, (list, tuple)) and not _values.is_tensor_like(value):
        for i, v in enumerate(value):
            _check_serialisable(v, f"{key}.{i}")
    elif not _values.is_tensor_like(value):
        try:
            pickle.dumps(value)
        except Exception as err:  # noqa: BLE001 - any pickling failure is the user's value
            raise TypeError(f"stage: the state dict's {key!r} ({type(value).__name__}) cannot be saved: {err}") \
                from None
