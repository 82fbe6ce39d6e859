"""The planning protocol (torch.distributed.checkpoint.planner).

A save runs ``set_up_planner`` -> ``create_local_plan`` (every rank) ->
``create_global_plan`` (coordinator) -> ``finish_plan`` (every rank) ->
``resolve_data`` (for each item the storage writes).  A load runs
``set_up_planner`` -> ``create_local_plan`` -> ``create_global_plan`` ->
``finish_plan`` -> ``load_bytes`` / ``resolve_tensor`` + ``commit_tensor``.

One difference from torch, forced by TensorFlow: tensors are immutable, so a
storage reader cannot copy bytes *into* the tensor ``resolve_tensor`` returns.
Here ``resolve_tensor`` returns the destination as a template (shape, dtype,
layout), the reader reads a new value with that layout, and ``commit_tensor``
puts it in place (``Variable.assign`` or replacing the state-dict entry).
"""

from __future__ import annotations

import abc
import io
import dataclasses
import enum
import math
from typing import Any

from tfdist.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties

__all__ = [
    "WriteItemType", "LoadItemType", "TensorWriteData", "WriteItem", "ReadItem", "SavePlan", "LoadPlan",
    "SavePlanner", "LoadPlanner",
]


class WriteItemType(enum.Enum):
    TENSOR = enum.auto()
    SHARD = enum.auto()
    BYTE_IO = enum.auto()


class LoadItemType(enum.Enum):
    TENSOR = enum.auto()
    BYTE_IO = enum.auto()


@dataclasses.dataclass(frozen=True)
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WriteItem:
    """One thing to write: a whole tensor, one chunk of a sharded one, or a pickled object."""

    index: MetadataIndex
    type: WriteItemType
    tensor_data: TensorWriteData | None = None

    def tensor_storage_size(self) -> int | None:
        """Bytes of the chunk this item writes (None for a non-tensor item)."""
        if self.tensor_data is None:
            return None
        import tensorflow as tf

        return math.prod(self.tensor_data.chunk.sizes) * tf.as_dtype(self.tensor_data.properties.dtype).size


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """Read ``lengths`` elements at ``storage_offsets`` of ``storage_index`` into ``dest_index`` at
    ``dest_offsets``."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: tuple[int, ...]
    storage_index: MetadataIndex
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclasses.dataclass
class LoadPlan:
    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """The save protocol; subclass :class:`DefaultSavePlanner` rather than this."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None: ...

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan: ...

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]: ...

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan: ...

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem) -> Any: ...


class LoadPlanner(abc.ABC):
    """The load protocol; subclass :class:`DefaultLoadPlanner` rather than this."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None: ...

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan: ...

    @abc.abstractmethod
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]: ...

    @abc.abstractmethod
    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan: ...

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value: Any) -> None: ...

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        """The ``io.BytesIO`` a storage reader fills for ``read_item``; it should alias one in the state
        dict.  As in torch, planners need not provide it (the default reader calls ``load_bytes``)."""
        raise NotImplementedError("LoadPlanner.resolve_bytes is not implemented")

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem) -> Any: ...

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor: Any) -> None: ...
