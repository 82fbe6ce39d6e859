"""A checkpoint's values read whole into host memory (for the format converters, off the training path)."""

from __future__ import annotations

import os
import pickle
from typing import Any

import tensorflow as tf

from tfdist.checkpoint import _tf_io
from tfdist.checkpoint.filesystem import FileSystemReader, object_bytes
from tfdist.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

__all__ = ["read_full_state_dict"]


def read_full_state_dict(dcp_checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Every value of a checkpoint, whole: tensors as ``tf.Tensor`` (host), objects as saved.

    Example::

        sd = read_full_state_dict("/tmp/ckpt")
        sd["model.dense.kernel"].shape
    """
    reader = FileSystemReader(dcp_checkpoint_dir)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    out: dict[str, Any] = {}
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    if tensors:
        prefix = str(reader.folder / metadata.storage_data["bundle"])
        names = list(tensors)
        values = reader._guarded(
            lambda: _tf_io.read_whole(prefix, names, [tf.as_dtype(tensors[n].properties.dtype) for n in names]),
            names, prefix, [tf.as_dtype(tensors[n].properties.dtype) for n in names])
        out.update(zip(names, values))
    objects: dict[str, dict] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            name = metadata.storage_data["objects"][key]
            if name not in objects:
                objects[name] = object_bytes((reader.folder / name).read_bytes())
            out[key] = pickle.loads(objects[name][key])
    return out
