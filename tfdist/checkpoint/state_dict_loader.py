"""load (torch.distributed.checkpoint.state_dict_loader)."""

from __future__ import annotations

import os
from typing import Any

from tfdist.checkpoint import _coordination, _dist
from tfdist.checkpoint.default_planner import DefaultLoadPlanner
from tfdist.checkpoint.planner import LoadPlanner
from tfdist.checkpoint.storage import StorageReader

__all__ = ["load", "load_state_dict"]


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: StorageReader | None = None, planner: LoadPlanner | None = None,
         process_group: Any = None, no_dist: bool = False) -> None:
    """Loads a checkpoint into ``state_dict`` in place, resharding as needed.

    Every value of ``state_dict`` says what to load and how it is laid out:
    a DTensor keeps its mesh and placements (which need not be the saving
    ones), a variable is assigned, a tensor or array is replaced by the
    loaded one, an object by the stored object; a :class:`Stateful` gets
    ``load_state_dict``.  Each device reads only the bytes of its own shard.

    Example::

        sd = {"w": distribute_tensor(tf.zeros((16, 4)), mesh2d, [Shard(0), Shard(1)]), "step": 0}
        tfdist.checkpoint.load(sd, checkpoint_id="/tmp/ckpt")   # sd["w"], sd["step"] now hold the saved values
    """
    _coordination.check_arguments("load", state_dict, process_group)
    reader = _coordination.storage("load", storage_reader, checkpoint_id, StorageReader,
                                   _coordination.DEFAULT_READER)
    planner = planner if planner is not None else DefaultLoadPlanner()
    _coordination.run_load(state_dict, reader, planner, _dist.Group(no_dist))


def load_state_dict(state_dict: dict[str, Any], storage_reader: StorageReader, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: LoadPlanner | None = None) -> None:
    """The older name of :func:`load` (torch keeps it, deprecated)."""
    if coordinator_rank != 0:
        raise ValueError(f"load_state_dict: the coordinator is rank 0. Received: coordinator_rank={coordinator_rank}")
    load(state_dict, storage_reader=storage_reader, planner=planner, process_group=process_group, no_dist=no_dist)
