"""save / async_save (torch.distributed.checkpoint.state_dict_saver)."""

from __future__ import annotations

import enum
import os
import threading
from concurrent.futures import Future
from typing import Any

from tfdist.checkpoint import _coordination, _dist, _tf_io, _writer_process
from tfdist.checkpoint.filesystem import FileSystemWriter
from tfdist.checkpoint.default_planner import DefaultSavePlanner
from tfdist.checkpoint.metadata import Metadata
from tfdist.checkpoint.planner import SavePlanner
from tfdist.checkpoint.staging import AsyncStager, BlockingAsyncStager
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
               async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
               async_stager: AsyncStager | None = None) -> Future:
    """Like :func:`save`, but returns once the state is staged; the writing runs in a thread.

    ``async_checkpointer_type=PROCESS`` also hands the tensor bundles to a persistent writer process
    (started with the first such save), so serialising them costs the training process nothing; the
    exchanges between clients and the commit stay in the thread.

    Staging snapshots every value (chunks on GPU/TPU are copied to host
    memory), so training may update the model while the checkpoint is
    written.  The stager is ``async_stager``, else the storage writer when it
    is an :class:`~tfdist.checkpoint.staging.AsyncStager` (``FileSystemWriter``
    is), else a :class:`~tfdist.checkpoint.staging.BlockingAsyncStager`, as in
    torch.  Errors surface on ``future.result()``; a failed async save, like
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
    if not isinstance(async_checkpointer_type, AsyncCheckpointerType):
        raise ValueError("async_save: async_checkpointer_type must be AsyncCheckpointerType.THREAD or .PROCESS. "
                         f"Received: async_checkpointer_type={async_checkpointer_type!r}")
    writer = _coordination.storage("async_save", storage_writer, checkpoint_id, StorageWriter,
                                   _coordination.DEFAULT_WRITER)
    in_process = async_checkpointer_type == AsyncCheckpointerType.PROCESS
    if in_process and not isinstance(writer, FileSystemWriter):
        raise ValueError("async_save(async_checkpointer_type=PROCESS) writes with tfdist's FileSystemWriter (its "
                         f"bundles go to the writer process). Received: storage_writer={writer!r}")
    planner = planner if planner is not None else DefaultSavePlanner()
    group = _dist.Group(no_dist=False)
    if async_stager is not None and not isinstance(async_stager, AsyncStager):
        raise TypeError(f"async_save: async_stager must be a tfdist.checkpoint.staging.AsyncStager. Received: "
                        f"async_stager={async_stager!r}")
    stager = async_stager or (writer if isinstance(writer, AsyncStager) else BlockingAsyncStager())
    staged = stager.stage(state_dict)
    plan, metadata = _coordination.plan_save(staged, writer, planner, group)
    future: Future = Future()

    def run() -> None:
        try:
            if in_process:  # this save's bundles are written by the persistent writer process
                writer._bundle_writer = _writer_process.write_bundle
            future.set_result(_coordination.write_and_commit(plan, metadata, writer, planner, group))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            future.set_exception(e)
        finally:
            if in_process:
                writer._bundle_writer = _tf_io.write_bundle

    threading.Thread(target=run, name="tfdist-async-save", daemon=False).start()
    if stager.should_synchronize_after_execute:
        stager.synchronize_staging()
    return future


def save_state_dict(state_dict: dict[str, Any], storage_writer: StorageWriter, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False,
                    planner: SavePlanner | None = None) -> Metadata:
    """The older name of :func:`save` (torch keeps it, deprecated)."""
    if coordinator_rank != 0:
        raise ValueError(f"save_state_dict: the coordinator is rank 0. Received: coordinator_rank={coordinator_rank}")
    return save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                no_dist=no_dist)
