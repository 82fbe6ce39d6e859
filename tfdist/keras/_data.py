"""Feeding batches to a distributed Keras model: host batches -> sharded TF DTensors.

Each leaf of a batch (x, y, sample_weight; any nesting) is split along its
first dim over the batch (data-parallel) mesh dim and placed with
``dtensor.pack``: every device receives only its own slice, with no
collective and no gather.  Scalars and tensors without a batch dim are
replicated.  A batch whose size is not divisible by the data-parallel size
(an epoch's last partial batch, ``predict`` on a few samples) is replicated
instead: every data-parallel replica computes it whole, so its loss,
metrics and gradients are exactly one device's (padding would change
Keras' ``sum_over_batch_size`` mean).  Only that batch pays the redundancy.

``BatchFeed`` is how ``fit``/``evaluate`` feed a distributed model: it takes over the
``tf.data`` dataset behind Keras' epoch iterator and appends one stage that splits each
batch into its data-parallel pieces (in tf.data's threads, ahead of the step) and a
prefetch; the step loop then only packs the ready pieces onto the mesh.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import numpy as np
import tensorflow as tf
from tensorflow.dtensor.python import api as dtensor_api
from tensorflow.experimental import dtensor
from tensorflow.python import _pywrap_dtensor_device
from tensorflow.python.eager import context, core
from tensorflow.python.framework import ops
from tensorflow.python.ops import gen_dataset_ops

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._redistribute import relayout

__all__ = ["shard_batch", "splits_evenly", "gather_to_numpy", "BatchFeed"]


def _pack(t: tf.Tensor, mesh: DeviceMesh, batch_axis: int | None) -> tf.Tensor:
    tf_mesh = mesh.to_tf()
    rank = t.shape.rank
    if rank == 0 or batch_axis is None:
        return dtensor.copy_to_mesh(t, dtensor.Layout.replicated(tf_mesh, rank))
    k = mesh.shape[batch_axis]
    n = t.shape[0]
    if n % k:  # a partial batch: every data-parallel replica takes it whole (see splits_evenly)
        return dtensor.copy_to_mesh(t, dtensor.Layout.replicated(tf_mesh, rank))
    return _pack_pieces(tf.split(t, k), mesh, batch_axis)


@functools.lru_cache(maxsize=64)
def _piece_of_device(mesh: DeviceMesh, batch_axis: int) -> tuple[int, ...]:
    """For each local device, in mesh order, the index of the data-parallel piece it holds
    (its coordinate on the batch mesh dim).  Computed once per mesh, not per step."""
    return tuple(coord[batch_axis] for coord in mesh.local_coordinates())


@functools.lru_cache(maxsize=256)
def _batch_layout(mesh: DeviceMesh, batch_axis: int, rank: int) -> tuple[dtensor.Layout, str]:
    """A rank-``rank`` layout sharded on dim 0 over the batch mesh dim, and its string (built
    once, not per step)."""
    layout = dtensor.Layout([mesh.axis_names[batch_axis]] + [dtensor.UNSHARDED] * (rank - 1), mesh.to_tf())
    return layout, layout.to_string()


def _pack_pieces(pieces, mesh: DeviceMesh, batch_axis: int) -> tf.Tensor:
    """The batch's k data-parallel pieces as one DTensor sharded on its first dim.

    Devices that share a batch coordinate (the tp devices of a 2x4 mesh) receive the same
    piece, so a 2x4 mesh slices each tensor twice, not eight times."""
    blocks = [pieces[i] for i in _piece_of_device(mesh, batch_axis)]
    return _pack_blocks(blocks, *_batch_layout(mesh, batch_axis, pieces[0].shape.rank))


_REGISTERED: dict[str, Any] = {}  # layout string -> the DTensor device dtensor.pack registered its mesh on


def _pack_blocks(blocks: list, layout: dtensor.Layout, layout_string: str) -> tf.Tensor:
    """``dtensor.pack(blocks, layout)``, without what ``pack`` redoes on every call.

    Per call ``pack`` builds the layout's mesh object, hashes it (a proto serialization) to
    check that the device knows it, and prints the layout; together 25 of its 45 us on a
    2x4 mesh, several times that on a step's busy main thread.  The first pack of a layout
    on a DTensor device goes through ``dtensor.pack`` (which registers the mesh); the next
    ones call the same kernel (``_pywrap_dtensor_device.Pack``, what ``pack`` ends in) with
    the layout's string printed once."""
    device = dtensor_api._dtensor_device()
    if _REGISTERED.get(layout_string) is not device:
        packed = dtensor.pack(blocks, layout)
        _REGISTERED[layout_string] = device
        return packed
    with ops.device(device.name):
        try:
            return _pywrap_dtensor_device.Pack(context.context()._handle, blocks, layout_string,
                                               device._device_info, False)
        except core._NotOkStatusException as error:
            raise core._status_to_exception(error) from None


def splits_evenly(data: Any, mesh: DeviceMesh, batch_axis: int | None) -> bool:
    """Whether every batched leaf of ``data`` splits evenly over the data-parallel mesh dim."""
    if batch_axis is None:
        return True
    k = mesh.shape[batch_axis]
    for x in tf.nest.flatten(data):
        shape = getattr(x, "shape", ())
        if len(shape) and shape[0] is not None and shape[0] % k:
            return False
    return True


def shard_batch(data: Any, mesh: DeviceMesh, batch_axis: int | None) -> Any:
    """Every tensor leaf of ``data`` as a TF DTensor sharded on its batch dim."""

    def one(x):
        if x is None:
            return None
        if isinstance(x, (tf.Tensor, np.ndarray)) or np.isscalar(x):
            t = tf.convert_to_tensor(x)
            if dtensor.is_dtensor(t):
                return t
            return _pack(t, mesh, batch_axis)
        return x

    return tf.nest.map_structure(one, data)


def gather_to_numpy(t: Any) -> Any:
    """A (possibly sharded) TF DTensor as one numpy array on the host."""
    if not isinstance(t, tf.Tensor) or not dtensor.is_dtensor(t):
        return t.numpy() if hasattr(t, "numpy") else t
    if t.shape.num_elements() == 0:  # nothing to gather (TF's gather of an empty shard crashes)
        return np.zeros(t.shape, t.dtype.as_numpy_dtype)
    layout = dtensor.fetch_layout(t)
    if not layout.is_fully_replicated():
        t = relayout(t, dtensor.Layout.replicated(layout.mesh, t.shape.rank), layout)
    return dtensor.unpack(t)[0].numpy()


# ----------------------------------------------------------------------------- the prefetching feed

PREFETCH = 2  # batches split and waiting ahead of the step


def _takes_over(iterator) -> bool:
    """Whether ``iterator`` is a ``tf.data`` iterator over plain dense tensors, whose dataset the
    feed can extend.  Anything else is fed batch by batch."""
    dataset = getattr(iterator, "_dataset", None)
    if not isinstance(dataset, tf.data.Dataset):
        return False
    return all(isinstance(spec, tf.TensorSpec) and spec.shape.rank is not None and spec.dtype != tf.string
               for spec in tf.nest.flatten(dataset.element_spec))


def _split_stage(k: int):
    """tf.data map: a batch -> one flat tuple: whether every batched leaf splits evenly over
    the k data-parallel pieces, then per leaf its batch size and k pieces (a scalar leaf: the
    scalar).  A batch that does not split evenly (an epoch's last) is zero-padded up to a
    multiple of k here and cut back to its size when it is placed, replicated; the even
    batches pay nothing for that.  Flat, so the feed reads it without rebuilding a nest, and
    the step loop converts one flag, not a size per leaf.  Plain Python over static shapes,
    so tf.data need not run AutoGraph over it (0.4 s of every fit's first epoch)."""

    @tf.autograph.experimental.do_not_convert
    def split(*element):
        out, sizes = [], []
        for leaf in tf.nest.flatten(element):
            if leaf.shape.rank == 0:
                out.append(leaf)
                continue
            n = tf.shape(leaf)[0]
            sizes.append(n)
            pad = (k - n % k) % k
            padded = tf.pad(leaf, [[0, pad]] + [[0, 0]] * (leaf.shape.rank - 1))
            out += [n, *tf.split(padded, k)]
        even = tf.reduce_all(tf.stack([n % k == 0 for n in sizes])) if sizes else tf.constant(True)
        return (even, *out)

    return split


def _leaf_slices(spec, k: int) -> list[slice]:
    """Where each leaf of a batch of ``spec`` sits in ``_split_stage``'s flat tuple."""
    slices, at = [], 1
    for leaf in tf.nest.flatten(spec):
        width = 1 if leaf.shape.rank == 0 else 1 + k
        slices.append(slice(at, at + width))
        at += width
    return slices


class BatchFeed:
    """Sharded batches for one Keras epoch iterator, split ahead of the step in ``tf.data``.

    When ``iterator`` is a ``tf.data`` iterator nothing has advanced yet (``fresh``: what Keras'
    ``fit``/``evaluate`` pass the step function the first time they pass it),
    the feed builds its own iterator over the same dataset plus two stages: a map that
    splits every batched tensor into its data-parallel pieces (``tf.split``, one per tensor,
    run by tf.data's threads while the previous step computes) and ``prefetch(PREFETCH)``.
    The step loop only packs the ready pieces onto the mesh (``dtensor.pack``, no copy on a
    host mesh).  Keras' own iterator is never advanced, so its tf.data autotuner never
    starts; the feed's iterator runs without the autotuner, whose thread TF joins when the
    iterator is deleted -- 0.4-24 s at the end of every epoch on a busy host (measured in
    docs/performance.md).  Other iterators are fed as before, split on the main thread.

    Example::

        feed = BatchFeed(iter(dataset), mesh, batch_axis=0, fresh=True)
        sharded, even = next(feed)

    An iterator that was advanced must be passed with ``fresh=False``: its dataset would
    replay the batches already taken (``OwnedIterator`` counts its ``next`` calls only in
    graph mode, so the feed cannot tell by itself).
    """

    def __init__(self, iterator, mesh: DeviceMesh, batch_axis: int | None, fresh: bool) -> None:
        self.mesh, self.batch_axis = mesh, batch_axis
        self.source = iterator
        self.taken_over = fresh and batch_axis is not None and _takes_over(iterator)
        if self.taken_over:
            dataset = iterator._dataset
            self._spec = dataset.element_spec
            options = tf.data.Options()
            options.autotune.enabled = False
            k = mesh.shape[batch_axis]
            staged = dataset.map(_split_stage(k)).prefetch(PREFETCH).with_options(options)
            self._iterator: Iterator = iter(staged)
            self._leaves = _leaf_slices(self._spec, k)
        else:
            self._iterator = iterator
        self._ahead: tuple | None = None  # a batch placed early by place_next: (batch,), or () at the end

    def place_next(self) -> None:
        """Places the next batch now, so the next ``next`` hands it over at once.

        Called right after a step is dispatched: TF DTensor runs that step on the device
        threads while the main thread packs the following batch, instead of packing it
        only after Keras has read the step's logs.  Only for a taken-over ``tf.data``
        pipeline, which already reads ``PREFETCH`` batches ahead: the order and content of
        the batches do not change; code inside the pipeline (a generator, a ``map``) runs
        one batch further ahead.  An error of the pipeline surfaces here, one step early."""
        if self._ahead is not None or not self.taken_over:
            return
        try:
            self._ahead = (self._next_placed(),)
        except StopIteration:
            self._ahead = ()

    def __iter__(self) -> "BatchFeed":
        return self

    def __next__(self) -> tuple[Any, bool]:
        """(the next batch as sharded DTensors, whether it split evenly over the batch dim)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            if not ahead:
                raise StopIteration
            return ahead[0]
        return self._next_placed()

    def _next_placed(self) -> tuple[Any, bool]:
        if not self.taken_over:
            element = next(self._iterator)
            even = splits_evenly(element, self.mesh, self.batch_axis)
            return shard_batch(element, self.mesh, self.batch_axis), even
        flat = self._get_next()
        even = bool(flat[0])
        leaves = [self._place(flat[at], even) for at in self._leaves]
        return tf.nest.pack_sequence_as(self._spec, leaves), even

    def _get_next(self) -> list:
        """The staged iterator's next element, flat: ``IteratorGetNext`` as the iterator's own
        ``next`` runs it, without rebuilding the element's nest (``_split_stage`` made it
        flat).  An iterator without those internals is read with ``next``."""
        iterator = self._iterator
        resource = getattr(iterator, "_iterator_resource", None)
        if resource is None:
            return list(next(iterator))
        try:
            with context.execution_mode(context.SYNC):  # its end comes as an error, so not async
                return gen_dataset_ops.iterator_get_next(resource, output_types=iterator._flat_output_types,
                                                         output_shapes=iterator._flat_output_shapes)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None

    def _place(self, leaf: list, even: bool) -> tf.Tensor:
        if len(leaf) == 1:  # a scalar: replicated
            return _pack(leaf[0], self.mesh, None)
        n, pieces = leaf[0], leaf[1:]
        if even:
            return _pack_pieces(pieces, self.mesh, self.batch_axis)
        return _pack(tf.concat(pieces, 0)[:int(n)], self.mesh, None)  # the epoch's partial batch, whole
