"""Sharding-invariant random values, computed locally on each shard.

TF DTensor's random ops draw per-device streams, so the same seed gives
different global values on different meshes or layouts.  tfdist instead
makes the value of every element a pure function of (seed, its global
index): each device builds the global indices of its own shard from
per-dim ``range`` vectors (1-D and tiny; the per-dim slice is local), mixes
them with a counter-based integer hash, and maps the hash to the
distribution.  No full-size tensor, no communication, and the same global
tensor on 1 device, on 8, on a 2x4 mesh, sharded any way.

The hash is Wellons' "lowbias32" finaliser applied twice with the seed
mixed in between: 32-bit unsigned arithmetic carried in int32 tensors (wrapping
add and multiply, xor, and a right shift that clears the sign bits it brings in
give the same bits).  Not uint32: where TF DTensor's layout propagation gathers
a hash value to another layout, it lowers the gather to ``CollectiveGatherV2``,
which has no uint32 kernel ("operand #0 must be tensor of ... 32-bit integer
... values, but got 'tensor<8x8x8xui32>'", keras-hub's GPT-2 dropout under a
layout map); it has int32.
Indices are taken modulo 2**32, so tensors with more than 4e9 elements
repeat their stream.

Inside one group's program of a computation vectorised over groups of rows
(HSDP's replica groups, ``vectorised_group``), a draw's indices start at the
group's first row, and Keras' seeds are drawn by the first trace of the
program and replayed by the second (the backward's), so each group and both
traces draw what one device draws for those rows.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor._layout import DTensorSpec, physical_layout
from tfdist.tensor.placement_types import Replicate, Shard

__all__ = ["uniform_bits", "uniform", "normal", "truncated_normal", "dropout", "draw_like", "next_seed",
           "reset_seed_states", "traced_unit", "vectorised_group", "group_seed"]

_U32 = tf.int32  # the carrier of 32-bit unsigned values (see above)


def _c(v: int) -> tf.Tensor:
    """The 32-bit unsigned ``v`` in the carrier (two's complement)."""
    v &= 0xFFFFFFFF
    return tf.constant(v - (1 << 32) if v >= 1 << 31 else v, _U32)


def _shr(x: tf.Tensor, k: int) -> tf.Tensor:
    """Logical right shift of 32-bit unsigned values held in int32 (TF's int32 shift is arithmetic)."""
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, _c(k)), _c((1 << (32 - k)) - 1))


def _lowbias32(x: tf.Tensor) -> tf.Tensor:
    x = tf.bitwise.bitwise_xor(x, _shr(x, 16))
    x = x * _c(0x7FEB352D)
    x = tf.bitwise.bitwise_xor(x, _shr(x, 15))
    x = x * _c(0x846CA68B)
    return tf.bitwise.bitwise_xor(x, _shr(x, 16))


def _global_index(spec: DTensorSpec) -> tf.Tensor:
    """32-bit (carrier) physical tensor (spec's layout, no Partial) of each element's flat global index."""
    root = spec.mesh.root_mesh
    ndim = len(spec.shape)
    strides = [math.prod(spec.shape[d + 1:]) for d in range(ndim)]
    index = None
    for d in range(ndim):
        m = spec.shard_mesh_dims.get(d)
        rep = physical_layout(root, [Replicate()] * root.ndim, 1)
        iota = dtensor.call_with_layout(tf.range, rep, spec.padded_size(d), dtype=tf.int64)
        if m is not None:  # dtensor cannot expand a sharded Range; slicing a replicated one is local
            placements = [Replicate()] * root.ndim
            placements[m] = Shard(0)
            iota = dtensor.relayout(iota, physical_layout(root, placements, 1))
        term = _c32(iota * strides[d] % (1 << 32))
        shape = [1] * ndim
        shape[d] = spec.padded_size(d)
        term = tf.reshape(term, shape)
        index = term if index is None else index + term
    if index is None:  # 0-d
        index = dtensor.call_with_layout(tf.zeros, spec.tf_layout, shape=(), dtype=_U32)
    return dtensor.relayout(index, spec.tf_layout)


def _c32(x: tf.Tensor) -> tf.Tensor:
    """int64 values in [0, 2**32) -> the carrier (their low 32 bits)."""
    return tf.cast(tf.where(x >= 1 << 31, x - (1 << 32), x), _U32)


def uniform_bits(spec: DTensorSpec, seed: tuple[int, int], stream: int = 0) -> tf.Tensor:
    """32-bit hash of (seed, stream, global index) with ``spec``'s physical layout."""
    k0 = (seed[0] * 0x9E3779B9 + stream * 0x85EBCA6B) & 0xFFFFFFFF
    k1 = (seed[1] * 0xC2B2AE35 + 0x27D4EB2F) & 0xFFFFFFFF
    return _lowbias32(tf.bitwise.bitwise_xor(_lowbias32(_global_index(spec) + _c(k0)), _c(k1)))


def _unit(bits: tf.Tensor, dtype: tf.DType, open_low: bool) -> tf.Tensor:
    """24 high bits -> [0, 1) (or (0, 1) when ``open_low``)."""
    top = tf.cast(_shr(bits, 8), dtype)
    return (top + (0.5 if open_low else 0.0)) * (2.0 ** -24)


def uniform(spec: DTensorSpec, seed: tuple[int, int], dtype: tf.DType, low=0.0, high=1.0) -> tf.Tensor:
    """Uniform [low, high) values."""
    u = _unit(uniform_bits(spec, seed), dtype, open_low=False)
    return u * (high - low) + low if (low, high) != (0.0, 1.0) else u


def _ndtri(u: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    # Vectorised and scalar ndtri kernels differ in the last ulp, and shards
    # of different sizes take different paths; float64 then rounding to the
    # target type makes the result the same whatever the shard size.
    return tf.cast(tf.math.ndtri(tf.cast(u, tf.float64)), dtype)


def normal(spec: DTensorSpec, seed: tuple[int, int], dtype: tf.DType, mean=0.0, stddev=1.0) -> tf.Tensor:
    """Normal values by the inverse CDF of a uniform draw (one hash per element)."""
    z = _ndtri(_unit(uniform_bits(spec, seed), tf.float64, open_low=True), dtype)
    return z * stddev + mean if (mean, stddev) != (0.0, 1.0) else z


def truncated_normal(spec: DTensorSpec, seed: tuple[int, int], dtype: tf.DType, mean=0.0, stddev=1.0) -> tf.Tensor:
    """Normal values restricted to two standard deviations (Keras' truncated_normal)."""
    u = _unit(uniform_bits(spec, seed), tf.float64, open_low=True)
    lo = 0.5 * math.erfc(2.0 / math.sqrt(2.0))  # Phi(-2)
    z = _ndtri(lo + u * (1.0 - 2.0 * lo), dtype)
    return z * stddev + mean


def _flat_index(shape: tf.Tensor, mesh: dtensor.Mesh | None) -> tf.Tensor:
    """32-bit (carrier) flat row-major index of every element of a tensor of (dynamic) ``shape``.

    One ``range`` per dim, pinned replicated on ``mesh`` (DTensor cannot
    expand a sharded Range), broadcast-added: layout propagation gives the
    sum the layout of the tensor it meets, so each device slices the tiny
    ranges and computes only its own shard's indices (checked: no
    collective, shard-sized intermediates).
    """
    rank = len(shape) if isinstance(shape, tuple) else shape.shape[0]
    index, stride = None, tf.constant(1, _U32)
    for d in reversed(range(rank)):
        iota = tf.range(shape[d])
        if mesh is not None:
            iota = dtensor.relayout(iota, dtensor.Layout.replicated(mesh, 1))
        term = tf.reshape(tf.cast(iota, _U32) * stride, [-1 if i == d else 1 for i in range(rank)])
        index = term if index is None else index + term
        stride = stride * tf.cast(shape[d], _U32)
    return tf.zeros([], _U32) if index is None else index


class _Group:
    def __init__(self, index: tf.Tensor, seeds: list, replay: bool) -> None:
        self.index, self.seeds, self.replay, self.drawn = index, seeds, replay, 0


_GROUP = threading.local()  # .state: the _Group whose program this thread traces, or None


@contextlib.contextmanager
def vectorised_group(index: tf.Tensor, seeds: list, replay: bool) -> Iterator[None]:
    """Draws traced inside are those of group ``index`` (its rows follow ``index`` groups of the
    same size); ``seeds`` collects the seeds drawn (``replay=False``) or hands them out again in
    order (``replay=True``: a second trace of the same program).

    Example (the forward and the backward's trace of one group's program)::

        seeds = []
        with vectorised_group(g, seeds, replay=False):
            y = model(rows, training=True)
        with vectorised_group(g, seeds, replay=True):
            y_again = model(rows, training=True)   # the same masks
    """
    before = getattr(_GROUP, "state", None)
    if not replay:
        seeds.clear()
    _GROUP.state = _Group(index, seeds, replay)
    try:
        yield
    finally:
        _GROUP.state = before


def group_seed(draw: Callable[[], tf.Tensor]) -> tf.Tensor:
    """``draw()`` (a Keras seed), recorded or replayed inside a ``vectorised_group``."""
    group = getattr(_GROUP, "state", None)
    if group is None:
        return draw()
    if group.replay:
        if group.drawn >= len(group.seeds):
            raise RuntimeError("a replica group's backward drew more random seeds than its forward did")
        group.drawn += 1
        return group.seeds[group.drawn - 1]
    seed = draw()
    group.seeds.append(seed)
    return seed


def _group_offset(shape) -> tf.Tensor:
    """The flat index of the group's first element in a draw of ``shape`` per group (0 outside)."""
    group = getattr(_GROUP, "state", None)
    if group is None:
        return tf.zeros([], _U32)
    size = math.prod(shape) if isinstance(shape, tuple) else tf.reduce_prod(shape)
    return tf.cast(group.index, _U32) * tf.cast(size, _U32)


def _seeded_bits(shape, seed: tf.Tensor, mesh: dtensor.Mesh | None, offset: tf.Tensor | None = None) -> tf.Tensor:
    """32-bit hash of (seed tensor, flat global index) for every element of ``shape``; ``offset``
    (carrier) is added to every index."""
    seed = tf.cast(seed, _U32)
    k0 = seed[0] * _c(0x9E3779B9) + _c(0x85EBCA6B)
    k1 = seed[1] * _c(0xC2B2AE35) + _c(0x27D4EB2F)
    index = _flat_index(shape, mesh) if offset is None else _flat_index(shape, mesh) + offset
    return _lowbias32(tf.bitwise.bitwise_xor(_lowbias32(index + k0), k1))


def _at_least(bits: tf.Tensor, threshold: int) -> tf.Tensor:
    """``bits >= threshold`` as 32-bit unsigned values: int32 with the sign bit flipped."""
    flipped = tf.bitwise.bitwise_xor(bits, tf.constant(-(2**31), tf.int32))
    return flipped >= tf.constant(threshold - 2**31, tf.int32)


def _dropout_fn(mesh: dtensor.Mesh | None):
    @tf.function(autograph=False)
    def drop(x: tf.Tensor, rate: float, noise_shape: tf.Tensor, seed: tf.Tensor, offset: tf.Tensor) -> tf.Tensor:
        keep = _at_least(_seeded_bits(noise_shape, seed, mesh, offset), min(int(rate * 2.0**32), 0xFFFFFFFF))
        return tf.where(keep, x / tf.cast(1.0 - rate, x.dtype), tf.zeros_like(x))

    return drop


def draw_like(
    kind: str, shape, seed: tf.Tensor, dtype: tf.DType, mesh: dtensor.Mesh | None = None,
    a: float = 0.0, b: float = 1.0,
) -> tf.Tensor:
    """Values for ``shape`` that are a pure function of (seed, global index), inside a traced
    program: ``kind`` "uniform" in ``[a, b)`` or "normal" with mean ``a``, stddev ``b``.

    Meant to be combined with an activation in the same program (Keras'
    GaussianNoise, GaussianDropout, AlphaDropout): layout propagation gives
    the draw the activation's layout, so each device computes its own
    shard.  Eagerly the result is a replicated DTensor on ``mesh``.
    """
    static = _static_shape(shape)
    shape = static if static is not None else tf.cast(shape, tf.int32)

    def draw(seed):
        offset = _group_offset(shape)  # the noise layers draw per row: their input's shape
        if kind == "uniform":
            return _unit(_seeded_bits(shape, seed, mesh, offset), dtype, open_low=False) * (b - a) + a
        return _ndtri(_unit(_seeded_bits(shape, seed, mesh, offset), tf.float64, open_low=True), dtype) * b + a

    if not tf.executing_eagerly():
        return draw(seed)
    if mesh is not None and not dtensor.is_dtensor(seed):
        seed = dtensor.copy_to_mesh(tf.convert_to_tensor(seed), dtensor.Layout.replicated(mesh, 1))
    return tf.function(draw, autograph=False)(seed)  # host ranges inside a DTensor program


_DROPOUT_FNS: dict = {}


def _static_shape(shape) -> tuple[int, ...] | None:
    """``shape`` as Python ints (DTensor slices only static ranges), or None if a dim is dynamic."""
    if isinstance(shape, tf.Tensor):  # a shape tensor (Keras passes tf.shape(x) inside a traced step)
        shape = tf.get_static_value(shape)
        if shape is None:
            return None
    dims = []
    for d in (shape.as_list() if isinstance(shape, tf.TensorShape) else list(shape)):
        value = d if isinstance(d, int) or d is None else tf.get_static_value(d)
        if value is None:
            return None
        dims.append(int(value))
    return tuple(dims)


def dropout(
    x: tf.Tensor, rate: float, noise_shape=None, seed: tf.Tensor | None = None, mesh: dtensor.Mesh | None = None,
) -> tf.Tensor:
    """Inverted dropout whose mask is a pure function of (seed, global element index).

    The same seed drops the same elements of the global tensor whatever the
    mesh and layout -- one device, 8, a 2x4 mesh -- unlike TF DTensor's own
    random ops (per-device streams).  ``seed`` is an integer tensor of two
    values (Keras' ``draw_seed``); ``noise_shape`` broadcasts the mask as in
    ``tf.nn.dropout``.  ``mesh``: the TF mesh ``x`` lives on (read from an
    eager DTensor; needed inside a traced function).  Runs as a traced
    function so that eager DTensor inputs work.

    Example::

        y = dropout(x, 0.1, seed=tf.constant([3, 7]))
    """
    if seed is None:
        raise ValueError("dropout needs seed: an integer tensor of two values (e.g. keras' draw_seed)")
    if mesh is None and tf.executing_eagerly() and dtensor.is_dtensor(x):
        mesh = dtensor.fetch_layout(x).mesh
    noise = _static_shape(x.shape if noise_shape is None else noise_shape)
    if noise is None:  # a dim known only at run time
        noise = tf.shape(x, out_type=tf.int32) if noise_shape is None else tf.cast(noise_shape, tf.int32)
    fn = _DROPOUT_FNS.get(mesh)
    if fn is None:
        fn = _DROPOUT_FNS[mesh] = _dropout_fn(mesh)
    # a mask per row (not broadcast over the batch) starts at the group's rows
    per_row = x.shape.rank and (noise[0] if isinstance(noise, tuple) else None) == x.shape[0]
    offset = _group_offset(noise) if per_row else tf.zeros([], _U32)
    return fn(x, float(rate), noise, seed, offset)


# -- seeds inside traced programs: one counter per mesh, as Keras' SeedGenerator keeps one ----------
_SEED_STATES: dict = {}


def next_seed(mesh: dtensor.Mesh, initial) -> tf.Tensor:
    """A fresh int64 seed pair for one draw inside a ``tf.function`` on ``mesh``.

    The state is a replicated ``DVariable`` on ``mesh`` (made outside any trace the first time, from
    ``initial()``, a pair of ints); each call reads it and advances its second value, so every call of
    the traced function draws new values, and a re-seeded process (:func:`reset_seed_states`) draws
    the same sequence again.
    """
    state = _SEED_STATES.get(mesh)
    if state is None:
        with tf.init_scope():
            value = dtensor.copy_to_mesh(tf.constant(initial(), tf.int64), dtensor.Layout.replicated(mesh, 1))
            state = _SEED_STATES[mesh] = dtensor.DVariable(value, trainable=False)
    seed = tf.identity(state.read_value())
    state.assign_add(tf.constant([0, 1], tf.int64))
    return seed


def reset_seed_states(initial) -> None:
    """Restarts every mesh's seed counter from ``initial()`` (``tfdist.manual_seed``)."""
    for mesh, state in _SEED_STATES.items():
        state.assign(dtensor.copy_to_mesh(tf.constant(initial(), tf.int64), dtensor.Layout.replicated(mesh, 1)))


def traced_unit(shape: tuple[int, ...], seed: tf.Tensor, mesh: dtensor.Mesh, dtype: tf.DType) -> tf.Tensor:
    """Uniform values in (0, 1) for the global ``shape`` inside a traced program: a pure function of
    (seed, global index), so the same on any mesh; layout propagation shards them like the
    parameters they meet."""
    return _unit(_seeded_bits(shape, seed, mesh), dtype, open_low=True)
