"""All-gathers of types TF DTensor's CollectiveGatherV2 does not carry.

TF lowers CollectiveGatherV2 only for int32/int64/f16/f32/f64
(``tensorflow/dtensor/mlir/collectives.cc``); other types fall back to an
all-reduce of a padded buffer.  Same-size types that TF does gather carry
their bits instead; 1-byte types travel in pairs.  ``all_gather`` picks the
route by dtype.
"""

from __future__ import annotations

import functools
import os

import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = ["all_gather", "gathers_natively"]


def all_gather(x: tf.Tensor, specs: list[str], new_specs: list[str], mesh: dtensor.Mesh) -> tf.Tensor:
    """``x`` (laid out ``specs``) relayouted to ``new_specs``, which unshards one physical dim:
    TF's gather, or the same bits carried as a type TF gathers natively."""
    carrier = _GATHER_CARRIER.get(x.dtype)
    if carrier is not None:
        return tf.bitcast(dtensor.relayout(tf.bitcast(x, carrier), dtensor.Layout(new_specs, mesh)), x.dtype)
    if x.dtype in _BYTE_TYPES and gathers_natively(mesh):
        paired = _gather_byte_pairs(x, specs, new_specs, mesh)
        if paired is not None:
            return paired
    return dtensor.relayout(x, dtensor.Layout(new_specs, mesh))


_GATHER_CARRIER = {
    tf.bfloat16: tf.float16, tf.int16: tf.float16, tf.uint16: tf.float16,
    tf.uint32: tf.int32, tf.uint64: tf.int64, tf.complex64: tf.int64,
}
_BYTE_TYPES = (tf.int8, tf.uint8, tf.bool)


def gathers_natively(mesh: dtensor.Mesh) -> bool:
    """Whether TF lowers a gather on ``mesh`` to CollectiveGatherV2 (TPU programs never do)."""
    return "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2" in os.environ and mesh.device_type().upper() != "TPU"


def _every_other(x: tf.Tensor, axis: int, start: int) -> tf.Tensor:
    begin, end, strides = [0] * x.shape.rank, list(x.shape), [1] * x.shape.rank
    begin[axis], strides[axis] = start, 2
    return tf.strided_slice(x, begin, end, strides)


def _gather_byte_pairs(x: tf.Tensor, specs: list[str], new_specs: list[str], mesh: dtensor.Mesh) -> tf.Tensor | None:
    """All-gathers a 1-byte tensor as 16-bit values, two bytes each, with the bytes of the data.

    TF has no CollectiveGatherV2 for 1-byte types (its fallback all-reduces a
    zero-padded, widened buffer), and a size-changing ``tf.bitcast`` crashes
    under TF DTensor.  So neighbours along a dim that stays whole are packed
    arithmetically into a uint16 (``lo + 256 hi``), carried as float16 bits,
    and unpacked after the gather -- all local, elementwise work.  An odd
    whole dim is padded by one (that column travels too).  With no whole dim,
    a dim whose local chunk is even is split into (n/2, 2) first (a local
    reshape).  Returns None when neither exists (the caller falls back).
    """
    shape = x.shape.as_list()
    if None in shape:
        return None
    split = None
    e = next((i for i in reversed(range(len(specs)))
              if specs[i] == new_specs[i] == dtensor.UNSHARDED and shape[i]), None)
    if e is None:
        k = {i: mesh.dim_size(t) for i, t in enumerate(specs) if t != dtensor.UNSHARDED}
        split = next((i for i in reversed(range(len(specs))) if shape[i] and (shape[i] // k.get(i, 1)) % 2 == 0), None)
        if split is None:
            return None
        x = tf.reshape(x, shape[:split] + [shape[split] // 2, 2] + shape[split + 1:])
        specs = specs[:split + 1] + [dtensor.UNSHARDED] + specs[split + 1:]
        new_specs = new_specs[:split + 1] + [dtensor.UNSHARDED] + new_specs[split + 1:]
        x, e = dtensor.relayout(x, dtensor.Layout(specs, mesh)), split + 1
    if tf.executing_eagerly():  # eagerly, TF DTensor's Pack would gather its inputs first: run it traced
        v = _byte_pairs_program(e, tuple(specs), tuple(new_specs), mesh)(x)
    else:
        v = _byte_pairs_gathered(x, e, specs, new_specs, mesh)
    if split is not None:
        v = tf.reshape(v, shape)
        new_specs = new_specs[:split + 1] + new_specs[split + 2:]
    return dtensor.relayout(v, dtensor.Layout(new_specs, mesh))


@functools.lru_cache(maxsize=256)
def _byte_pairs_program(e: int, specs: tuple, new_specs: tuple, mesh: dtensor.Mesh):
    return tf.function(lambda x: _byte_pairs_gathered(x, e, list(specs), list(new_specs), mesh), autograph=False)


def _byte_pairs_gathered(x: tf.Tensor, e: int, specs: list[str], new_specs: list[str], mesh: dtensor.Mesh) -> tf.Tensor:
    """``_gather_byte_pairs`` along whole dim ``e``: pack, gather, unpack (same dtype and shape)."""
    dtype, n = x.dtype, x.shape[e]
    layout = dtensor.Layout(specs, mesh)
    v = tf.math.floormod(tf.cast(x, tf.int32), 256)  # int8 -128..127 -> its byte 0..255
    if n % 2:
        pads = [[0, 0]] * len(specs)
        pads[e] = [0, 1]
        v = dtensor.relayout(tf.pad(v, pads), layout)
    packed = _every_other(v, e, 0) + 256 * _every_other(v, e, 1)
    packed = tf.bitcast(tf.cast(dtensor.relayout(packed, layout), tf.uint16), tf.float16)
    packed = dtensor.relayout(packed, dtensor.Layout(new_specs, mesh))  # the all-gather
    packed = tf.cast(tf.bitcast(packed, tf.uint16), tf.int32)
    pairs = tf.stack([tf.math.floormod(packed, 256), tf.math.floordiv(packed, 256)], axis=e + 1)
    pairs = dtensor.relayout(pairs, dtensor.Layout(new_specs[:e + 1] + [dtensor.UNSHARDED] + new_specs[e + 1:], mesh))
    shape = pairs.shape.as_list()
    v = tf.reshape(pairs, shape[:e] + [shape[e] * 2] + shape[e + 2:])
    if n % 2:
        size = list(v.shape)
        size[e] = n
        v = tf.slice(v, [0] * len(size), size)
    if dtype == tf.bool:
        return tf.not_equal(v, 0)
    if dtype == tf.int8:
        return tf.cast(v - 256 * tf.cast(v >= 128, tf.int32), tf.int8)
    return tf.cast(v, dtype)
