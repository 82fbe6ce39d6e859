"""The storage protocol (torch.distributed.checkpoint.storage)."""

from __future__ import annotations

import abc
import dataclasses
import os
from concurrent.futures import Future
from typing import Any

from tfdist.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from tfdist.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

__all__ = ["WriteResult", "StorageWriter", "StorageReader"]


@dataclasses.dataclass(frozen=True)
class WriteResult:
    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


class StorageWriter(abc.ABC):
    """Writes a save plan's items.  Called in order: ``reset``, ``set_up_storage_writer``,
    ``prepare_local_plan``, ``prepare_global_plan`` (coordinator), ``write_data``, ``finish``
    (coordinator)."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None: ...

    @abc.abstractmethod
    def set_up_storage_writer(self, is_coordinator: bool) -> None: ...

    @abc.abstractmethod
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan: ...

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]: ...

    @abc.abstractmethod
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future: ...

    @abc.abstractmethod
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None: ...

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool: ...

    def storage_meta(self) -> StorageMeta | None:
        return None


class StorageReader(abc.ABC):
    """Reads a load plan's items.  Called in order: ``reset``, ``read_metadata``,
    ``set_up_storage_reader``, ``prepare_local_plan``, ``prepare_global_plan`` (coordinator),
    ``read_data``."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None: ...

    @abc.abstractmethod
    def read_metadata(self) -> Metadata: ...

    @abc.abstractmethod
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None: ...

    @abc.abstractmethod
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan: ...

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]: ...

    @abc.abstractmethod
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future: ...

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool: ...
