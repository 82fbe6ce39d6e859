"""Independent references: what each device should hold, derived with numpy.

torch.chunk semantics by hand: ``n`` rows over ``k`` devices give chunks of
``c = ceil(n / k)``; device ``i`` holds rows ``[i*c, min((i+1)*c, n))``.
"""

from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf

from tfdist.tensor import DTensor, Partial, Replicate, Shard


def chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    c = -(-n // k)
    lo = min(i * c, n)
    return lo, min(lo + c, n)


def expected_shard(x: np.ndarray, mesh_shape, placements, coord) -> np.ndarray:
    """The slice of global ``x`` that the device at mesh ``coord`` holds.

    A dim sharded by several mesh dims is chunked by the first, then the
    chunk by the next, ... (torch's nesting, in mesh-dim order).
    """
    lo = [0] * x.ndim
    hi = list(x.shape)
    for p, k, c in zip(placements, mesh_shape, coord):
        if isinstance(p, Shard):
            a, b = chunk_bounds(hi[p.dim] - lo[p.dim], k, c)
            lo[p.dim], hi[p.dim] = lo[p.dim] + a, lo[p.dim] + b
    return x[tuple(slice(a, b) for a, b in zip(lo, hi))]


def coords(mesh_shape):
    return list(itertools.product(*[range(k) for k in mesh_shape]))


def assert_dtensor_equal(expected: np.ndarray, placements, result: DTensor, *, rtol=1e-6, atol=1e-6):
    """Checks value, placements, dtype, global shape and every local shard."""
    assert isinstance(result, DTensor), type(result)
    assert tuple(result.placements) == tuple(placements), (result.placements, placements)
    assert tuple(result.shape) == expected.shape
    assert result.dtype == tf.as_dtype(expected.dtype)
    np.testing.assert_allclose(result.numpy(), expected, rtol=rtol, atol=atol)
    if any(isinstance(p, Partial) for p in placements):
        return
    mesh = result.device_mesh
    root = mesh.root_mesh
    for local, root_coord in zip(result.local_tensors(), root.local_coordinates()):
        own = [root_coord[d] for d in mesh.root_dims]
        want = expected_shard(expected, mesh.shape, placements, own)
        assert tuple(local.shape) == want.shape, (own, local.shape, want.shape)
        np.testing.assert_allclose(local.numpy(), want, rtol=rtol, atol=atol)


def all_placements(ndim_tensor: int, mesh_ndim: int):
    """Every Shard/Replicate combination (no tensor dim sharded twice)."""
    options = [Replicate()] + [Shard(d) for d in range(ndim_tensor)]
    for combo in itertools.product(options, repeat=mesh_ndim):
        dims = [p.dim for p in combo if isinstance(p, Shard)]
        if len(dims) == len(set(dims)):
            yield combo
