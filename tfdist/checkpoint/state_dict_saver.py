"""save / async_save (torch.distributed.checkpoint.state_dict_saver)."""

from __future__ import annotations

import enum
import os
import threading
from concurrent.futures import Future
from typing import Any

from tfdist.checkpoint import _coordination, _dist, _values
from tfdist.checkpoint.default_planner import DefaultSavePlanner
from tfdist.checkpoint.metadata import Metadata
from tfdist.checkpoint.planner import SavePlanner
from tfdist.checkpoint.storage import StorageWriter

__all__ = ["save", "async_save", "AsyncCheckpointerType", "save_state_dict"]


class AsyncCheckpointerType(enum.Enum):
    THREAD = "thread"
    PROCESS = "process"


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: Any = None, no_dist: bool = False) -> Metadata:
    """Saves ``state_dict`` SPMD-style: every client writes the chunks it holds, once each.

    Values may be tfdist DTensors, TF DTensors, variables (Keras or TF),
    tensors, numpy arrays, nested dicts/lists of them, other picklable objects
    and :class:`Stateful` objects.  The checkpoint can be loaded onto any
    mesh or number of clients.  A failed save leaves the previous checkpoint
    in ``checkpoint_id`` loadable.

    Example::

        mesh = tfdist.init_device_mesh("cpu", (8,))
        sd = {"w": distribute_tensor(tf.ones((16, 4)), mesh, [Shard(0)]), "step": 10}
        tfdist.checkpoint.save(sd, checkpoint_id="/tmp/ckpt")
    """
    _coordination.check_arguments("save", state_dict, process_group)
    writer = _coordination.storage("save", storage_writer, checkpoint_id, StorageWriter,
                                   _coordination.DEFAULT_WRITER)
    planner = planner if planner is not None else DefaultSavePlanner()
    group = _dist.Group(no_dist)
    plan, metadata = _coordination.plan_save(_coordination.stateful_values(state_dict), writer, planner, group)
    return _coordination.write_and_commit(plan, metadata, writer, planner, group)


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
               process_group: Any = None,
               async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD) -> Future:
    """Like :func:`save`, but returns once the state is staged; the writing runs in a thread.

    Staging snapshots every value (chunks on GPU/TPU are copied to host
    memory), so training may update the model while the checkpoint is
    written.  Errors surface on ``future.result()``; a failed async save, like
    a failed save, leaves the previous checkpoint in place.  The writing
    thread talks to other clients only through TF's coordination service,
    never through device collectives, so it cannot interleave with the
    training step's.

    Example::

        future = tfdist.checkpoint.async_save(sd, checkpoint_id="/tmp/ckpt")
        train_more_steps()
        future.result()   # Metadata; raises if the save failed
    """
    _coordination.check_arguments("async_save", state_dict, process_group)
    if async_checkpointer_type != AsyncCheckpointerType.THREAD:
        raise ValueError(
            "async_save: tfdist writes in a thread of the training process (TF tensors cannot be handed to "
            "another process without a copy through numpy). Received: "
            f"async_checkpointer_type={async_checkpointer_type!r}; use AsyncCheckpointerType.THREAD."
        )
    writer = _coordination.storage("async_save", storage_writer, checkpoint_id, StorageWriter,
                                   _coordination.DEFAULT_WRITER)
    planner = planner if planner is not None else DefaultSavePlanner()
    group = _dist.Group(no_dist=False)
    state = _coordination.stateful_values(state_dict)
    values = _values.read_variables(_leaves(state))
    staged = {k: _stage_tree(v, values) for k, v in state.items()}
    plan, metadata = _coordination.plan_save(staged, writer, planner, group)
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(_coordination.write_and_commit(plan, metadata, writer, planner, group))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            future.set_exception(e)

    threading.Thread(target=run, name="tfdist-async-save", daemon=False).start()
    return future


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


def save_state_dict(state_dict: dict[str, Any], storage_writer: StorageWriter, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False,
                    planner: SavePlanner | None = None) -> Metadata:
    """The older name of :func:`save` (torch keeps it, deprecated)."""
    if coordinator_rank != 0:
        raise ValueError(f"save_state_dict: the coordinator is rank 0. Received: coordinator_rank={coordinator_rank}")
    return save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                no_dist=no_dist)
