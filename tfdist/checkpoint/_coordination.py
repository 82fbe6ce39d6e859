"""The SPMD protocol of a save and a load: who plans, who writes, who commits.

Every step that can fail is followed by an agreement between clients, so a
failure on any client makes every client raise and none commits: the
coordinator deletes the half-written save directory and ``.metadata`` keeps
naming the previous checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from tfdist.checkpoint import _dist
from tfdist.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from tfdist.checkpoint.metadata import Metadata
from tfdist.checkpoint.planner import LoadPlanner, SavePlan, SavePlanner
from tfdist.checkpoint.stateful import Stateful, stateful_values  # noqa: F401 (callers use it from here)
from tfdist.checkpoint.storage import StorageReader, StorageWriter


def check_arguments(api: str, state_dict: Any, process_group: Any) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"{api}: state_dict must be a dict. Received: state_dict of type {type(state_dict).__name__}")
    if process_group is not None:
        raise ValueError(
            f"{api}: a tfdist checkpoint spans every client of the program; process_group must be None. "
            f"Received: process_group={process_group!r}"
        )


def storage(api: str, given: Any, checkpoint_id: Any, kind: type, default: type) -> Any:
    if given is None:
        if checkpoint_id is None:
            raise ValueError(f"{api}: pass checkpoint_id (a directory) or a storage object; both are None.")
        if not default.validate_checkpoint_id(checkpoint_id):
            raise ValueError(f"{api}: checkpoint_id must be a local path. Received: checkpoint_id={checkpoint_id!r}")
        return default(os.fspath(checkpoint_id))
    if not isinstance(given, kind):
        raise TypeError(f"{api}: expected a {kind.__name__}. Received: {type(given).__name__}")
    given.reset(checkpoint_id)
    return given


def on_coordinator(group: _dist.Group, fn: Callable[[], Any], what: str) -> Any:
    """Runs ``fn`` on the coordinator and hands every client its result (or its failure)."""
    outcome: tuple[str | None, Any] = (None, None)
    if group.is_coordinator:
        try:
            outcome = (None, fn())
        except Exception as e:  # noqa: BLE001 - re-raised below on every client
            if not group.distributed:
                raise
            outcome = (f"{type(e).__name__}: {e}", None)
            group.broadcast(outcome)
            raise
    error, value = group.broadcast(outcome)
    if error is not None:
        raise _dist.CheckpointError(f"{what} failed on rank 0: {error}")
    return value


def locally(group: _dist.Group, fn: Callable[[], Any], what: str) -> Any:
    """Runs ``fn`` on every client; if it fails anywhere, raises everywhere."""
    value, error = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001
        error = e
    _dist.check_all(group, error, what)
    return value


def plan_save(state_dict: dict, writer: StorageWriter, planner: SavePlanner,
              group: _dist.Group) -> tuple[SavePlan, Metadata]:
    writer.set_up_storage_writer(group.is_coordinator)
    planner.set_up_planner(state_dict, writer.storage_meta(), group.is_coordinator)
    local = locally(group, lambda: writer.prepare_local_plan(planner.create_local_plan()), "save planning")
    plans = group.gather(local)

    def global_plan():
        new_plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(new_plans), metadata

    new_plans, metadata = on_coordinator(group, global_plan, "save planning")
    plan = planner.finish_plan(new_plans[group.rank])
    return plan, metadata


def write_and_commit(plan: SavePlan, metadata: Metadata, writer: StorageWriter, planner: SavePlanner,
                     group: _dist.Group) -> Metadata:
    try:
        results = locally(group, lambda: writer.write_data(plan, planner).result(), "save")
        all_results = group.gather(results)
        on_coordinator(group, lambda: writer.finish(metadata, all_results), "save commit")
    except BaseException:
        if group.is_coordinator and hasattr(writer, "abort"):
            writer.abort()
        raise
    return metadata


def run_load(state_dict: dict, reader: StorageReader, planner: LoadPlanner, group: _dist.Group) -> None:
    work = stateful_values(state_dict)
    metadata = locally(group, reader.read_metadata, "load")
    locally(group, lambda: reader.set_up_storage_reader(metadata, group.is_coordinator), "load")
    planner.set_up_planner(work, metadata, group.is_coordinator)
    local = locally(group, lambda: reader.prepare_local_plan(planner.create_local_plan()), "load planning")
    plans = group.gather(local)
    new_plans = on_coordinator(group, lambda: reader.prepare_global_plan(planner.create_global_plan(plans)),
                               "load planning")
    plan = planner.finish_plan(new_plans[group.rank])
    locally(group, lambda: reader.read_data(plan, planner).result(), "load")
    for key, value in state_dict.items():
        if isinstance(value, Stateful):
            value.load_state_dict(work[key])
        else:
            state_dict[key] = work[key]


DEFAULT_WRITER, DEFAULT_READER = FileSystemWriter, FileSystemReader
