"""Reading and writing TensorFlow tensor bundles (the format of ``tf.train.Checkpoint``).

Writes: each client saves the chunks it owns with ``SaveV2`` and a slice spec
(``"8 12 0,4:0,3"``: global shape, then start,length per dim), the same way
DTensor's own SaveV2 expansion saves a device's shard; the coordinator folds
all bundles into one with ``MergeV2Checkpoints``.  Reads: on a CPU mesh one
``DTensorRestoreV2`` per mesh restores every tensor straight into its target
layout, each device reading only the slice it holds (TF's bundle reader
assembles it from whichever stored chunks overlap); on GPU/TPU meshes, whose
tensors DTensorRestoreV2 refuses ("Restoring a non CPU Tensor is not supported
currently", tensorflow/dtensor/python/save_restore.py), each local device's
slice is read with ``RestoreV2`` on the host and packed onto the device.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.dtensor.python import gen_dtensor_ops
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._layout import DTensorSpec, placements_from_tf_layout


def slice_spec(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> str:
    """TF's slice spec of a chunk; ``""`` for the whole tensor."""
    if tuple(offsets) == (0,) * len(shape) and tuple(sizes) == tuple(shape):
        return ""
    dims = " ".join(str(int(s)) for s in shape)
    parts = ":".join(f"{int(o)},{int(n)}" for o, n in zip(offsets, sizes))
    return f"{dims} {parts}"


def write_bundle(prefix: str, names: list[str], slices: list[str], tensors: list[tf.Tensor]) -> None:
    with tf.device("CPU:0"):
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=slices, tensors=tensors)


def merge_bundles(prefixes: list[str], destination: str) -> None:
    with tf.device("CPU:0"):
        tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=prefixes, destination_prefix=destination,
                                      delete_old_dirs=False)


def read_whole(prefix: str, names: list[str], dtypes: list[tf.DType]) -> list[tf.Tensor]:
    with tf.device("CPU:0"):
        return list(tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=names,
                                         shape_and_slices=[""] * len(names), dtypes=dtypes))


def read_sharded(prefix: str, names: list[str], shapes: list[tuple[int, ...]], layouts: list[dtensor.Layout],
                 dtypes: list[tf.DType], force_per_device: bool = False) -> list[tf.Tensor]:
    """Restores ``names`` (all on one mesh) as TF DTensors with ``layouts``."""
    mesh = layouts[0].mesh
    if mesh.device_type().upper() == "CPU" and not force_per_device:
        n = mesh.num_local_devices()
        host = dtensor.Layout.replicated(mesh.host_mesh(), rank=0)
        with tf.device(dtensor.device_name()):
            return list(gen_dtensor_ops.d_tensor_restore_v2(
                prefix=dtensor.pack([prefix] * n, host),
                tensor_names=dtensor.pack([names] * n, dtensor.Layout.replicated(mesh.host_mesh(), rank=1)),
                shape_and_slices=dtensor.pack([[""] * len(names)] * n,
                                              dtensor.Layout.replicated(mesh.host_mesh(), rank=1)),
                input_shapes=[tf.TensorShape(s) for s in shapes],
                input_layouts=[lay.to_string() for lay in layouts],
                dtypes=dtypes,
            ))
    return [_read_per_device(prefix, name, shape, layout, dtype)
            for name, shape, layout, dtype in zip(names, shapes, layouts, dtypes)]


def _read_per_device(prefix: str, name: str, shape: tuple[int, ...], layout: dtensor.Layout,
                     dtype: tf.DType) -> tf.Tensor:
    spec = DTensorSpec(DeviceMesh.from_tf(layout.mesh), placements_from_tf_layout(layout), tuple(shape))
    coords = spec.mesh.local_coordinates()
    slices = []
    for coord in coords:
        sizes, offsets = spec.local_shape_and_offset(coord)
        slices.append(slice_spec(shape, offsets, sizes))
    with tf.device("CPU:0"):
        # one RestoreV2 reads every local device's slice (replicas read once each)
        unique = sorted(set(slices))
        values = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[name] * len(unique),
                                      shape_and_slices=unique, dtypes=[dtype] * len(unique))
    by_slice = dict(zip(unique, values))
    return dtensor.pack([by_slice[s] for s in slices], layout)
