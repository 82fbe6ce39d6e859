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
mixed in between (uint32 arithmetic, which TF runs on every device type).
Indices are taken modulo 2**32, so tensors with more than 4e9 elements
repeat their stream.
"""

from __future__ import annotations

import math

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor._layout import DTensorSpec, physical_layout
from tfdist.tensor.placement_types import Replicate, Shard

__all__ = ["uniform_bits", "uniform", "normal", "truncated_normal"]

_U32 = tf.uint32


def _c(v: int) -> tf.Tensor:
    return tf.constant(v & 0xFFFFFFFF, _U32)


def _lowbias32(x: tf.Tensor) -> tf.Tensor:
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _c(16)))
    x = x * _c(0x7FEB352D)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _c(15)))
    x = x * _c(0x846CA68B)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _c(16)))


def _global_index(spec: DTensorSpec) -> tf.Tensor:
    """uint32 physical tensor (spec's layout, no Partial) of each element's flat global index."""
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
        term = tf.cast(iota * strides[d] % (1 << 32), _U32)
        shape = [1] * ndim
        shape[d] = spec.padded_size(d)
        term = tf.reshape(term, shape)
        index = term if index is None else index + term
    if index is None:  # 0-d
        index = dtensor.call_with_layout(tf.zeros, spec.tf_layout, shape=(), dtype=_U32)
    return dtensor.relayout(index, spec.tf_layout)


def uniform_bits(spec: DTensorSpec, seed: tuple[int, int], stream: int = 0) -> tf.Tensor:
    """uint32 hash of (seed, stream, global index) with ``spec``'s physical layout."""
    k0 = (seed[0] * 0x9E3779B9 + stream * 0x85EBCA6B) & 0xFFFFFFFF
    k1 = (seed[1] * 0xC2B2AE35 + 0x27D4EB2F) & 0xFFFFFFFF
    return _lowbias32(tf.bitwise.bitwise_xor(_lowbias32(_global_index(spec) + _c(k0)), _c(k1)))


def _unit(bits: tf.Tensor, dtype: tf.DType, open_low: bool) -> tf.Tensor:
    """24 high bits -> [0, 1) (or (0, 1) when ``open_low``)."""
    top = tf.cast(tf.bitwise.right_shift(bits, _c(8)), dtype)
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
