"""Distributed checkpoint (torch.distributed.checkpoint): save, load, async_save with resharding.

Every client writes the chunks it holds into TensorFlow's tensor-bundle format
(the format of ``tf.train.Checkpoint``); a checkpoint saved on one mesh or
number of clients loads onto any other, each device reading only its slice.

Example (8 virtual CPUs)::

    import tensorflow as tf, tfdist
    import tfdist.checkpoint as dcp
    from tfdist.tensor import Shard, distribute_tensor

    mesh = tfdist.init_device_mesh("cpu", (2, 4))
    sd = {"w": distribute_tensor(tf.reshape(tf.range(32.0), (8, 4)), mesh, [Shard(0), Shard(1)])}
    dcp.save(sd, checkpoint_id="/tmp/ckpt")
    target = {"w": distribute_tensor(tf.zeros((8, 4)), tfdist.init_device_mesh("cpu", (8,)), [Shard(0)])}
    dcp.load(target, checkpoint_id="/tmp/ckpt")
"""

from tfdist.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from tfdist.checkpoint.filesystem import CheckpointCorruptError, FileSystemReader, FileSystemWriter
from tfdist.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)
from tfdist.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType,
)
from tfdist.checkpoint._dist import CheckpointError
from tfdist.checkpoint.state_dict_loader import load, load_state_dict
from tfdist.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save, save, save_state_dict
from tfdist.checkpoint.stateful import Stateful
from tfdist.checkpoint import staging
from tfdist.checkpoint.storage import StorageReader, StorageWriter, WriteResult

__all__ = [
    "save", "load", "async_save", "save_state_dict", "load_state_dict", "AsyncCheckpointerType",
    "FileSystemWriter", "FileSystemReader", "StorageWriter", "StorageReader", "WriteResult",
    "DefaultSavePlanner", "DefaultLoadPlanner", "SavePlanner", "LoadPlanner", "SavePlan", "LoadPlan",
    "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
    "Metadata", "MetadataIndex", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "StorageMeta", "Stateful", "CheckpointCorruptError", "CheckpointError", "staging",
]
