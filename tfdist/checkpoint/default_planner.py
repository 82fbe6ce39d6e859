"""DefaultSavePlanner / DefaultLoadPlanner (torch.distributed.checkpoint.default_planner).

Save: nested dicts and lists are flattened to dotted keys; each tensor becomes
one WriteItem per distinct chunk this client holds, each object one BYTE_IO
item; the coordinator drops duplicates (a replicated value or chunk is written
by the lowest rank holding it) and builds the Metadata.  Load: one ReadItem per
tensor, the whole destination: TensorFlow's bundle reader assembles each
device's slice from whichever stored chunks overlap it, so every device reads
only the bytes of its own shard whatever the saving mesh was.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any

import tensorflow as tf

from tfdist.checkpoint import _values
from tfdist.checkpoint.metadata import (
    BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from tfdist.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType,
)

__all__ = ["DefaultSavePlanner", "DefaultLoadPlanner", "flatten_state_dict", "unflatten_state_dict"]

Path = tuple  # of str keys / int positions


def flatten_state_dict(state_dict: dict) -> tuple[dict[str, Any], dict[str, Path]]:
    """``{"model": {"w": x}, "opt": [a, b]}`` -> ``{"model.w": x, "opt.0": a, "opt.1": b}`` and the
    key -> path mapping to put values back."""
    flat: dict[str, Any] = {}
    mappings: dict[str, Path] = {}

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                visit(path + (k,), v)
        elif isinstance(value, (list, tuple)) and value and not _values.is_tensor_like(value):
            for i, v in enumerate(value):
                visit(path + (i,), v)
        else:
            key = ".".join(str(p) for p in path)
            if key in flat:
                raise ValueError(f"state_dict: two entries flatten to the same key {key!r}; rename one.")
            flat[key] = value
            mappings[key] = path

    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise TypeError(f"state_dict keys must be str. Received: key {k!r} of type {type(k).__name__}")
        visit((k,), v)
    return flat, mappings


def set_element(root: dict, path: Path, value: Any) -> None:
    node = root
    for p in path[:-1]:
        node = node[p]
    if isinstance(node, tuple):
        raise TypeError(f"state_dict: cannot load {'.'.join(map(str, path))!r} in place inside a tuple; use a list.")
    node[path[-1]] = value


def unflatten_state_dict(flat: dict[str, Any], mappings: dict[str, Path]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        path = mappings.get(key, (key,))
        node = out
        for p, nxt in zip(path[:-1], path[1:]):
            node = node.setdefault(p, [] if isinstance(nxt, int) else {})
            if isinstance(node, list) and isinstance(nxt, int):
                while len(node) <= nxt:
                    node.append(None)
        if isinstance(node, list):
            node[path[-1]] = value
        else:
            node[path[-1]] = value
    return out


class DefaultSavePlanner(SavePlanner):
    """The standard save planner.

    Example::

        planner = DefaultSavePlanner(dedup_replicated_tensors=True)
        tfdist.checkpoint.save({"model": sd}, checkpoint_id="/tmp/ckpt", planner=planner)
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None, dedup_save_to_lowest_rank: bool = False,
                 enable_plan_caching: bool = False) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.dedup_replicated_tensors = True if dedup_replicated_tensors is None else dedup_replicated_tensors
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank
        self.enable_plan_caching = enable_plan_caching
        self.mappings: dict[str, Path] = {}

    def set_up_planner(self, state_dict: dict, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.storage_meta = storage_meta
        self.is_coordinator = is_coordinator
        self._storable: dict[str, tf.Tensor] = {}
        self._chunks: dict[str, dict[tuple, tf.Tensor]] = {}

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The state-dict value ``index`` names."""
        if index.fqn not in self.state_dict:
            raise KeyError(f"the state_dict has no entry {index.fqn!r}")
        return self.state_dict[index.fqn]

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 (torch's name)
        """torch's protocol: a BYTE_IO item's object is serialised into an ``io.BytesIO`` (pickle here,
        ``torch.save`` in torch); a storage writer stores its bytes."""
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            pickle.dump(object, buffer)
            buffer.seek(0)
            return buffer
        return object

    def _tensor(self, fqn: str) -> tf.Tensor:
        if fqn not in self._storable:
            self._storable[fqn] = _values.storable(self.state_dict[fqn])
        return self._storable[fqn]

    def create_local_plan(self) -> SavePlan:
        items, layouts = [], {}
        for fqn, obj in self.state_dict.items():
            if not _values.is_tensor_like(obj):
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
                continue
            t = self._tensor(fqn)
            if _values.is_sharded(t):
                layouts[fqn] = _values.describe_layout(t)
            props, size = TensorProperties(t.dtype.name), tuple(t.shape)
            kind = WriteItemType.SHARD if _values.is_sharded(t) else WriteItemType.TENSOR
            for piece in _values.local_chunks(t, with_values=False):
                items.append(WriteItem(MetadataIndex(fqn, piece.chunk.offsets), kind,
                                       TensorWriteData(piece.chunk, props, size)))
        return SavePlan(items, planner_data={"layouts": layouts})

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self.dedup_replicated_tensors:
            all_plans = _dedup_to_lowest_rank(all_plans)
        entries: dict[str, Any] = {}
        for plan in all_plans:
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    entries[fqn] = BytesStorageMetadata()
                    continue
                td = item.tensor_data
                md = entries.setdefault(fqn, TensorStorageMetadata(td.properties, td.size, []))
                if not isinstance(md, TensorStorageMetadata) or md.size != td.size:
                    raise ValueError(f"save: ranks disagree about {fqn!r} (size {md.size} vs {td.size}).")
                if td.chunk not in md.chunks:
                    md.chunks.append(td.chunk)
        for md in entries.values():
            if isinstance(md, TensorStorageMetadata):
                md.chunks.sort(key=lambda c: tuple(c.offsets))
        layouts: dict[str, Any] = {}
        for plan in all_plans:
            layouts.update((plan.planner_data or {}).get("layouts", {}))
        planner_data = {"mappings": {k: list(v) for k, v in self.mappings.items()}, "layouts": layouts}
        return all_plans, Metadata(entries, planner_data=planner_data)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        """The value to store for ``write_item``: the object, or the tensor of the item's chunk (for a
        sharded value, the shard of the first local device holding that chunk: a local view)."""
        if write_item.type == WriteItemType.BYTE_IO:
            return self.transform_object(write_item, self.lookup_object(write_item.index))
        fqn = write_item.index.fqn
        if fqn not in self._chunks:
            pieces = _values.local_chunks(self._tensor(fqn), with_values=True)
            self._chunks[fqn] = {tuple(p.chunk.offsets): p.value for p in pieces}
        offsets = tuple(write_item.tensor_data.chunk.offsets)
        if offsets not in self._chunks[fqn]:
            raise ValueError(f"save: {fqn!r} has no chunk at offset {offsets} on this client.")
        return self.transform_object(write_item, self._chunks[fqn][offsets])


def _dedup_to_lowest_rank(plans: list[SavePlan]) -> list[SavePlan]:
    """Each (fqn, offset) is written once, by the lowest rank that has it."""
    seen: set[tuple[str, Any]] = set()
    out = []
    for plan in plans:
        keep = []
        for item in plan.items:
            key = (item.index.fqn, item.index.offset)
            if key not in seen:
                seen.add(key)
                keep.append(item)
        out.append(dataclasses.replace(plan, items=keep))
    return out


class DefaultLoadPlanner(LoadPlanner):
    """The standard load planner: loads every key of ``state_dict`` in place.

    ``allow_partial_load=False`` (default) raises if a key of ``state_dict``
    is missing from the checkpoint.  Shapes must match the checkpoint's;
    placements and meshes may differ freely (resharding).

    Example::

        sd = {"w": distribute_tensor(tf.zeros((8, 8)), mesh, [Shard(0)])}
        tfdist.checkpoint.load(sd, checkpoint_id="/tmp/ckpt", planner=DefaultLoadPlanner())
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.allow_partial_load = allow_partial_load
        self.mappings: dict[str, Path] = {}

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        source = (self.metadata.storage_meta.checkpoint_id if self.metadata.storage_meta else None) or "the checkpoint"
        items = []
        for fqn, obj in self.state_dict.items():
            if fqn not in stored:
                if self.allow_partial_load:
                    continue
                raise KeyError(
                    f"load: key {fqn!r} is missing from {source} (it holds {len(stored)} keys, e.g. "
                    f"{sorted(stored)[:5]}). Pass DefaultLoadPlanner(allow_partial_load=True) to skip it."
                )
            md = stored[fqn]
            if isinstance(md, BytesStorageMetadata):
                items.append(ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), (), MetadataIndex(fqn), (), ()))
                continue
            if not _values.is_tensor_like(obj):
                raise TypeError(f"load: {fqn!r} is a tensor in {source} but the state_dict holds a "
                                f"{type(obj).__name__}; pre-allocate a tensor of shape {tuple(md.size)}.")
            shape, dtype = _values.template_shape_dtype(obj)
            if tuple(shape) != tuple(md.size):
                raise ValueError(f"load: {fqn!r} has shape {tuple(md.size)} in {source}, the state_dict's is "
                                 f"{tuple(shape)}.")
            if dtype.name != md.properties.dtype:
                raise ValueError(f"load: {fqn!r} has dtype {md.properties.dtype} in {source}, the state_dict's "
                                 f"is {dtype.name}.")
            zeros = (0,) * len(shape)
            items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, zeros), zeros,
                                  MetadataIndex(fqn, zeros), zeros, tuple(shape)))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def lookup_tensor(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn]

    def transform_tensor(self, read_item: ReadItem, tensor: Any) -> Any:
        return tensor

    def resolve_tensor(self, read_item: ReadItem) -> Any:
        """The destination (its shape, dtype and layout say what to read)."""
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))

    def commit_tensor(self, read_item: ReadItem, tensor: Any) -> None:
        """Puts the value read for ``read_item`` in place."""
        fqn = read_item.dest_index.fqn
        self._set(fqn, _values.put_back(self.state_dict[fqn], tensor))

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Puts an object in place from the ``io.BytesIO`` a storage reader gives (torch's protocol; a
        reader that gives the object itself is accepted too)."""
        if isinstance(value, io.BytesIO):
            value.seek(0)
            value = pickle.load(value)
        self._set(read_item.dest_index.fqn, value)

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        """The ``io.BytesIO`` a storage reader may fill in place for ``read_item``: the state dict's own,
        when its value is one (torch's contract: it aliases the state dict's)."""
        value = self.state_dict.get(read_item.dest_index.fqn)
        if not isinstance(value, io.BytesIO):
            raise NotImplementedError(
                f"resolve_bytes: the state dict's {read_item.dest_index.fqn!r} is a {type(value).__name__}, not an "
                "io.BytesIO to fill in place; its value is loaded with load_bytes.")
        return value

    def _set(self, fqn: str, value: Any) -> None:
        self.state_dict[fqn] = value
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.original_state_dict[fqn] = value
