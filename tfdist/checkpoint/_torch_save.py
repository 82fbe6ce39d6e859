"""torch.save files <-> tfdist checkpoints (torch's format_utils converters), with torch installed.

torch is an optional extra (``pip install tfdist[torch]``): these are the only tfdist functions that
import it, lazily, and they run off the training path (whole tensors through host memory).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.checkpoint import _values
from tfdist.checkpoint._dist import Group
from tfdist.checkpoint._whole import read_full_state_dict
from tfdist.checkpoint.default_planner import DefaultLoadPlanner, flatten_state_dict
from tfdist.checkpoint.filesystem import FileSystemReader, _done
from tfdist.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from tfdist.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from tfdist.checkpoint.state_dict_saver import save
from tfdist.checkpoint.storage import StorageReader

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner"]


def _torch(caller: str):
    try:
        import torch
    except ImportError:
        raise ImportError(f"{caller} reads or writes torch.save files and needs torch: pip install "
                          "'tfdist[torch]' (torch is not a dependency of tfdist otherwise).") from None
    return torch


def _to_tf(value: Any, torch) -> Any:
    """torch tensors (anywhere in nested dicts/lists) -> tf tensors; bfloat16 through float32 (exact)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.dtype == torch.bfloat16:
            return tf.cast(tf.constant(t.float().numpy()), tf.bfloat16)
        return tf.constant(t.numpy())
    if isinstance(value, dict):
        return {k: _to_tf(v, torch) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_tf(v, torch) for v in value)
    return value


def _to_torch(value: Any, torch) -> Any:
    if isinstance(value, (tf.Tensor, np.ndarray)):
        t = tf.convert_to_tensor(value)
        if t.dtype == tf.bfloat16:
            return torch.from_numpy(tf.cast(t, tf.float32).numpy()).to(torch.bfloat16)
        return torch.from_numpy(np.array(t.numpy()))
    return value


def _nest(flat: dict[str, Any], mappings: dict[str, list]) -> dict[str, Any]:
    """A checkpoint's flat keys back into the nested dicts and lists (tuples come back as lists) it was
    saved from, following the key -> path mappings its metadata keeps."""
    out: dict = {}
    for key, value in flat.items():
        path = list(mappings.get(key, [key]))
        node: Any = out
        for part, nxt in zip(path[:-1], path[1:]):
            child = _get(node, part)
            if child is None:
                child = [] if isinstance(nxt, int) else {}
                _put(node, part, child)
            node = child
        _put(node, path[-1], value)
    return out


def _get(node: Any, part: Any) -> Any:
    if isinstance(node, list):
        return node[part] if part < len(node) else None
    return node.get(part)


def _put(node: Any, part: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (part + 1 - len(node)))
    node[part] = value


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike) -> None:
    """Writes a checkpoint as one ``torch.save`` file: its state dict, nested as saved, tensors whole.

    Example::

        dcp_to_torch_save("/tmp/ckpt", "/tmp/model.pt")
        sd = torch.load("/tmp/model.pt")
    """
    torch = _torch("dcp_to_torch_save")
    flat = read_full_state_dict(dcp_checkpoint_dir)
    metadata = FileSystemReader(dcp_checkpoint_dir).read_metadata()
    mappings = (metadata.planner_data or {}).get("mappings", {})
    torch.save(_nest({k: _to_torch(v, torch) for k, v in flat.items()}, mappings), os.fspath(torch_save_path))


def torch_save_to_dcp(torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike) -> None:
    """Writes a ``torch.save`` file's state dict as a checkpoint (loadable onto any mesh).

    Example::

        torch_save_to_dcp("/tmp/model.pt", "/tmp/ckpt")
    """
    torch = _torch("torch_save_to_dcp")
    state = torch.load(os.fspath(torch_save_path), weights_only=False, map_location="cpu")
    if not isinstance(state, dict):
        raise ValueError(f"torch_save_to_dcp: {torch_save_path} holds a {type(state).__name__}, not a state dict.")
    save(_to_tf(state, torch), checkpoint_id=dcp_checkpoint_dir, no_dist=True)


class DynamicMetaLoadPlanner(DefaultLoadPlanner):
    """A load planner for storage without metadata (a ``torch.save`` file): the metadata is made from
    the state dict being loaded (its keys, shapes and dtypes), as torch's is.

    Example::

        dcp.load(sd, storage_reader=BroadcastingTorchSaveReader("/tmp/model.pt"),
                 planner=DynamicMetaLoadPlanner())
    """

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        entries = {}
        for fqn, obj in self.state_dict.items():
            if _values.is_tensor_like(obj):
                shape, dtype = _values.template_shape_dtype(obj)
                shape = tuple(shape)
                entries[fqn] = TensorStorageMetadata(TensorProperties(dtype.name), shape,
                                                     [ChunkStorageMetadata((0,) * len(shape), shape)])
            else:
                entries[fqn] = BytesStorageMetadata()
        self.metadata = Metadata(entries, storage_meta=metadata.storage_meta if metadata else None)


def _payload(flat: dict[str, Any], fqn: str, kind: LoadItemType) -> tuple[str, Any] | None:
    """What the coordinator sends for one entry (None: the file lacks it): an object, or a tensor as numpy
    (bfloat16, which numpy lacks, as float32: exact)."""
    if fqn not in flat:
        return None
    value = flat[fqn]
    if kind != LoadItemType.TENSOR:
        return "object", value
    if value.dtype == tf.bfloat16:
        return "bfloat16", tf.cast(value, tf.float32).numpy()
    return "tensor", value.numpy()


class BroadcastingTorchSaveReader(StorageReader):
    """Reads a ``torch.save`` file for :func:`tfdist.checkpoint.load`: the coordinator client reads the
    file and sends each value to the others (through TF's coordination service), each client puts it
    on its own mesh.  Use with :class:`DynamicMetaLoadPlanner` (the file has no metadata).

    Args:
        checkpoint_id: the ``torch.save`` file.
        coordinator_rank: the client that reads the file (only client 0 coordinates in tfdist).
    """

    def __init__(self, checkpoint_id: str | os.PathLike | None = None, coordinator_rank: int = 0) -> None:
        if coordinator_rank != 0:
            raise ValueError("BroadcastingTorchSaveReader: client 0 coordinates tfdist checkpoints. Received: "
                             f"coordinator_rank={coordinator_rank}")
        self.checkpoint_id = checkpoint_id
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id

    def read_metadata(self) -> Metadata:
        return Metadata({}, storage_meta=StorageMeta(checkpoint_id=os.fspath(self.checkpoint_id)))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        group = Group(no_dist=False)
        flat = self._read_file() if group.is_coordinator else None
        for item in plan.items:  # every client issues the same items in the same order
            fqn = item.storage_index.fqn
            sent = group.broadcast(_payload(flat, fqn, item.type) if group.is_coordinator else None)
            if sent is None:
                raise KeyError(f"load: {self.checkpoint_id} has no entry {fqn!r}")
            kind, value = sent
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(pickle.dumps(value)))
                continue
            tensor = tf.cast(value, tf.bfloat16) if kind == "bfloat16" else tf.convert_to_tensor(value)
            planner.resolve_tensor(item)
            planner.commit_tensor(item, tensor)
        return _done(None)

    def _read_file(self) -> dict[str, Any]:
        torch = _torch("BroadcastingTorchSaveReader")
        state = torch.load(os.fspath(self.checkpoint_id), weights_only=False, map_location="cpu")
        return {k: _to_tf(v, torch) for k, v in flatten_state_dict(state)[0].items()}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.fspath(checkpoint_id))
