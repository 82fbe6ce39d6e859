"""FileSystemWriter / FileSystemReader: a checkpoint is a directory.

::

    <checkpoint>/.metadata              JSON, written last and atomically (rename)
    <checkpoint>/save-<id>/data.index   one TF tensor bundle for all tensors
    <checkpoint>/save-<id>/data.data-*  (each client wrote its own chunks, then they were merged)
    <checkpoint>/save-<id>/r<k>.objects pickled non-tensor values of rank k

Each save writes into a new ``save-<id>`` directory and only then replaces
``.metadata``; the previous save's directory is deleted after that.  A save
that dies at any point therefore leaves the previous checkpoint loadable, and
a half-written one is never named by ``.metadata``.  ``.metadata`` records the
size of every file and a CRC32 of the bundle index and object files; the
bundle itself stores a CRC32C of every tensor chunk, checked by TensorFlow on
read.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
import shutil
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import tensorflow as tf

from tfdist.checkpoint import _tf_io, _values
from tfdist.checkpoint.metadata import Metadata, StorageMeta
from tfdist.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType,
)
from tfdist.checkpoint.staging import BlockingAsyncStager
from tfdist.checkpoint.storage import StorageReader, StorageWriter, WriteResult

__all__ = ["FileSystemWriter", "FileSystemReader", "CheckpointCorruptError"]

METADATA = ".metadata"
BUNDLE = "data"


class CheckpointCorruptError(ValueError):
    """A checkpoint file is missing, truncated or fails its checksum."""


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _crc32(path: pathlib.Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: pathlib.Path, data: bytes, sync: bool) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        _fsync(path.parent)


class _Directory:
    """A checkpoint that is a local directory (``checkpoint_id`` is its path)."""

    path: pathlib.Path

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = pathlib.Path(os.fspath(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in os.fspath(checkpoint_id)


class FileSystemWriter(_Directory, StorageWriter, BlockingAsyncStager):
    """Writes a checkpoint directory (see the module docstring for its layout).

    Args:
        path: the checkpoint directory (created if missing).
        single_file_per_rank: each client writes its chunks into one bundle
            (``False``: one bundle per value); all are merged into one at the end.
        sync_files: fsync every file before the metadata commit.
        thread_count: threads writing this client's bundles in parallel.
        per_thread_copy_ahead: accepted for torch compatibility (TF stages by reference).
        cache_staged_state_dict: as :class:`~tfdist.checkpoint.staging.BlockingAsyncStager`'s (its ``stage``
            is this writer's: ``async_save`` stages with it).
        overwrite: ``False`` refuses to replace an existing checkpoint in ``path``.

    Example::

        writer = FileSystemWriter("/tmp/ckpt", thread_count=4)
        tfdist.checkpoint.save({"model": sd}, storage_writer=writer)
    """

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True, _extensions: Any = None) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int. Received: thread_count={thread_count!r}")
        self.path = pathlib.Path(os.fspath(path))
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self._bundle_writer = _tf_io.write_bundle  # async_save(PROCESS) hands it to the writer process
        self.overwrite = overwrite
        self.is_coordinator = False

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.path))

    def set_up_storage_writer(self, is_coordinator: bool) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not self.overwrite and (self.path / METADATA).exists():
            raise FileExistsError(f"save: {self.path} already holds a checkpoint and overwrite=False.")
        save_id = f"save-{time.time_ns():x}-{uuid.uuid4().hex[:8]}"
        (self.path / save_id).mkdir(parents=True)
        self._save_id = save_id
        return [dataclasses.replace(p, storage_data={"save_id": save_id, "rank": r}) for r, p in enumerate(plans)]

    # -- writing ------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        save_id, rank = plan.storage_data["save_id"], plan.storage_data["rank"]
        self._save_id = save_id
        folder = self.path / save_id
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        objects = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        results = []
        if objects:
            name = f"r{rank:05d}.objects"
            data = pickle.dumps({_BYTES_FORMAT: 1, "items": {i.index.fqn: _as_bytes(planner.resolve_data(i), i)
                                                             for i in objects}})
            _write_atomically(folder / name, data, self.sync_files)
            results += [WriteResult(i.index, len(data), {"objects": name}) for i in objects]
        groups = self._bundles(tensors)
        prefixes = [str(folder / f"r{rank:05d}-b{k:04d}") for k in range(len(groups))]
        jobs = list(zip(prefixes, groups))
        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(self.thread_count) as pool:
                list(pool.map(lambda job: self._write_bundle(job[0], job[1], planner), jobs))
        else:
            for prefix, items in jobs:
                self._write_bundle(prefix, items, planner)
        for prefix, items in jobs:
            bundle = os.path.basename(prefix)
            results += [WriteResult(i.index, i.tensor_storage_size() or 0, {"bundle": bundle}) for i in items]
        return _done(results)

    def _bundles(self, items: list[WriteItem]) -> list[list[WriteItem]]:
        if not items:
            return []
        if not self.single_file_per_rank:
            by_fqn: dict[str, list[WriteItem]] = {}
            for i in items:
                by_fqn.setdefault(i.index.fqn, []).append(i)
            return list(by_fqn.values())
        n = min(self.thread_count, len(items))
        groups: list[list[WriteItem]] = [[] for _ in range(n)]
        loads = [0] * n
        for i in sorted(items, key=lambda i: -(i.tensor_storage_size() or 0)):  # balance bytes per thread
            k = loads.index(min(loads))
            groups[k].append(i)
            loads[k] += i.tensor_storage_size() or 0
        return [g for g in groups if g]

    def _write_bundle(self, prefix: str, items: list[WriteItem], planner: SavePlanner) -> None:
        names, slices, values = [], [], []
        for item in items:
            td = item.tensor_data
            value = tf.convert_to_tensor(planner.resolve_data(item))  # this chunk's tensor
            if tuple(value.shape) != tuple(td.chunk.sizes):
                raise ValueError(f"save: resolve_data gave {item.index.fqn!r} a chunk of shape {tuple(value.shape)}, "
                                 f"its write item says {tuple(td.chunk.sizes)}.")
            names.append(item.index.fqn)
            slices.append(_tf_io.slice_spec(td.size, td.chunk.offsets, td.chunk.sizes))
            values.append(tf.cast(value, td.properties.dtype) if value.dtype.name != td.properties.dtype else value)
        self._bundle_writer(prefix, names, slices, values)
        if self.sync_files:
            for f in pathlib.Path(prefix).parent.glob(pathlib.Path(prefix).name + ".*"):
                _fsync(f)

    # -- commit -----------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Merges the bundles and commits ``.metadata`` (the coordinator, after every rank wrote)."""
        flat = [r for per_rank in results for r in per_rank]
        folder = self.path / self._save_id
        bundles = sorted({r.storage_data["bundle"] for r in flat if "bundle" in r.storage_data})
        if bundles:
            _tf_io.merge_bundles([str(folder / b) for b in bundles], str(folder / BUNDLE))
            for b in bundles:  # merged data files were renamed; drop what is left of the inputs
                for f in folder.glob(b + ".*"):
                    f.unlink()
        objects = {r.index.fqn: r.storage_data["objects"] for r in flat if "objects" in r.storage_data}
        files = {}
        for f in sorted(folder.iterdir()):
            if self.sync_files:
                _fsync(f)
            entry = {"size": f.stat().st_size}
            if f.name.endswith(".index") or f.name.endswith(".objects"):
                entry["crc32"] = _crc32(f)
            files[f.name] = entry
        if self.sync_files:
            _fsync(folder)
        metadata.storage_data = {"folder": folder.name, "bundle": BUNDLE if bundles else None,
                                 "objects": objects, "files": files}
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.path), save_id=folder.name)
        _write_atomically(self.path / METADATA, metadata.to_json().encode(), self.sync_files)
        self._remove_other_saves(keep=folder.name)

    def abort(self) -> None:
        """Removes this save's directory (after a failure; the previous checkpoint is untouched)."""
        save_id = getattr(self, "_save_id", None)
        if save_id:
            shutil.rmtree(self.path / save_id, ignore_errors=True)

    def _remove_other_saves(self, keep: str) -> None:
        for entry in self.path.iterdir():
            if entry.is_dir() and entry.name.startswith("save-") and entry.name != keep:
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(METADATA + ".tmp"):
                entry.unlink(missing_ok=True)


_BYTES_FORMAT = "__tfdist_object_bytes__"  # an objects file holding each object's bytes (torch's BYTE_IO)


def _as_bytes(data: Any, item: WriteItem) -> bytes:
    """What ``resolve_data`` gave for a BYTE_IO item (torch's protocol: an ``io.BytesIO``) as bytes."""
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    raise TypeError(f"save: resolve_data must give an io.BytesIO for the object {item.index.fqn!r} (torch's "
                    f"BYTE_IO protocol). Received: {type(data).__name__}")


def object_bytes(content: bytes) -> dict[str, bytes]:
    """An objects file's entries as each object's bytes (files of tfdist before it kept bytes: re-pickled)."""
    loaded = pickle.loads(content)
    if isinstance(loaded, dict) and loaded.get(_BYTES_FORMAT) == 1:
        return loaded["items"]
    return {k: pickle.dumps(v) for k, v in loaded.items()}


class FileSystemReader(_Directory, StorageReader):
    """Reads a checkpoint directory written by :class:`FileSystemWriter`.

    Example::

        tfdist.checkpoint.load(sd, storage_reader=FileSystemReader("/tmp/ckpt"))
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None) -> None:
        self.path = pathlib.Path(os.fspath(path))
        self.per_device_reads = False  # GPU/TPU meshes always read per device; tests force it on CPU

    def read_metadata(self) -> Metadata:
        path = self.path / METADATA
        if not path.is_file():
            raise FileNotFoundError(
                f"load: no checkpoint at {self.path} (no {METADATA} file; a save that did not finish writes none)."
            )
        metadata = Metadata.from_json(path.read_text(), source=str(path))
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.path),
                                            save_id=metadata.storage_data.get("folder"))
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        self.metadata = metadata
        self.folder = self.path / metadata.storage_data["folder"]
        for name, entry in metadata.storage_data["files"].items():
            f = self.folder / name
            if not f.is_file():
                raise CheckpointCorruptError(f"load: checkpoint file {f} is missing.")
            size = f.stat().st_size
            if size != entry["size"]:
                raise CheckpointCorruptError(
                    f"load: checkpoint file {f} has {size} bytes, {entry['size']} were written (truncated or "
                    "overwritten)."
                )
            if "crc32" in entry and f.name.endswith(".index") and _crc32(f) != entry["crc32"]:
                raise CheckpointCorruptError(f"load: checkpoint file {f} fails its CRC32 check (corrupted).")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        objects = [i for i in plan.items if i.type == LoadItemType.BYTE_IO]
        tensors = [i for i in plan.items if i.type == LoadItemType.TENSOR]
        self._read_objects(objects, planner)
        self._read_tensors(tensors, planner)
        return _done(None)

    def _read_objects(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        loaded: dict[str, dict] = {}
        for item in items:
            name = self.metadata.storage_data["objects"][item.storage_index.fqn]
            if name not in loaded:
                f = self.folder / name
                expected = self.metadata.storage_data["files"][name].get("crc32")
                if expected is not None and _crc32(f) != expected:
                    raise CheckpointCorruptError(
                        f"load: {item.storage_index.fqn!r}: checkpoint file {f} fails its CRC32 check (corrupted)."
                    )
                loaded[name] = object_bytes(f.read_bytes())
            planner.load_bytes(item, io.BytesIO(loaded[name][item.storage_index.fqn]))

    def _read_tensors(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        if not items:
            return
        prefix = str(self.folder / self.metadata.storage_data["bundle"])
        stored = self.metadata.state_dict_metadata
        plain, by_mesh = [], {}
        for item in items:
            template = planner.resolve_tensor(item)
            layout = _values.target_layout(template)
            if layout is None:
                plain.append(item)
            else:
                by_mesh.setdefault(layout.mesh.to_string(), []).append((item, layout))
        if plain:
            names = [i.storage_index.fqn for i in plain]
            dtypes = [tf.as_dtype(stored[n].properties.dtype) for n in names]
            values = self._guarded(lambda: _tf_io.read_whole(prefix, names, dtypes), names, prefix, dtypes)
            for item, value in zip(plain, values):
                planner.commit_tensor(item, value)
        for group in by_mesh.values():
            names = [i.storage_index.fqn for i, _ in group]
            dtypes = [tf.as_dtype(stored[n].properties.dtype) for n in names]
            shapes = [tuple(stored[n].size) for n in names]
            layouts = [lay for _, lay in group]
            values = self._guarded(
                lambda: _tf_io.read_sharded(prefix, names, shapes, layouts, dtypes, self.per_device_reads),
                names, prefix, dtypes)
            for (item, _), value in zip(group, values):
                planner.commit_tensor(item, value)

    def _guarded(self, read, names: list[str], prefix: str, dtypes: list[tf.DType]) -> list[tf.Tensor]:
        try:
            return read()
        except tf.errors.OpError as e:
            # find the key (reads each whole tensor on its own; only on this failure path)
            for name, dtype in zip(names, dtypes):
                try:
                    _tf_io.read_whole(prefix, [name], [dtype])
                except tf.errors.OpError as each:
                    raise CheckpointCorruptError(
                        f"load: reading {name!r} from {prefix}.* failed: {each.message.splitlines()[0]}"
                    ) from None
            raise CheckpointCorruptError(f"load: reading from {prefix}.* failed: {e.message.splitlines()[0]}") \
                from None
