"""Factory functions: zeros, ones, empty, full, rand, randn directly on a mesh.

Constant values are produced already sharded: ``dtensor.call_with_layout``
makes TF DTensor create only the local shard on every device, with no
full-size tensor and no communication.  Random values are drawn replicated
from one stateless seed and sliced locally, so that the same seed gives the
same global tensor on any mesh (TF DTensor's own sharded random ops do not).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh, resolve_mesh
from tfdist.tensor._api import DTensor
from tfdist.tensor._layout import DTensorSpec, normalize_placements
from tfdist.tensor._redistribute import redistribute_physical
from tfdist.tensor.placement_types import Placement, Replicate

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn"]


def _size(size: tuple, caller: str) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, tf.TensorShape)):
        size = tuple(size[0])
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in size):
        raise ValueError(
            f"{caller} size must be non-negative ints, e.g. {caller}(4, 8) or "
            f"{caller}((4, 8)). Received: size={size!r}"
        )
    return tuple(size)


def _make(
    caller: str, make, size: tuple, dtype, device_mesh, placements, *, per_shard: bool = True
) -> DTensor:
    """Builds the value with ``make(shape, dtype)``.

    ``per_shard``: ``make`` is position-independent (zeros, fill), so each
    device creates just its shard.  Otherwise (random values) the value is
    made replicated and sliced locally, so the global values do not depend on
    the mesh or placements.
    """
    shape = _size(size, caller)
    mesh = resolve_mesh(device_mesh, caller)
    placements = normalize_placements(placements, mesh, len(shape))
    for p in placements:
        if p.is_partial():
            raise ValueError(
                f"{caller} cannot create {p!r}: factories make Shard/Replicate "
                f"values. Received: placements={placements!r}"
            )
    spec = DTensorSpec(mesh, placements, shape)
    dtype = tf.as_dtype(dtype or tf.float32)
    if per_shard:
        physical = dtensor.call_with_layout(make, spec.tf_layout, shape=spec.physical_shape, dtype=dtype)
        return DTensor._wrap(physical, spec)
    replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, shape)
    physical = dtensor.call_with_layout(make, replicated.tf_layout, shape=shape, dtype=dtype)
    return DTensor._wrap(redistribute_physical(physical, replicated, spec), spec)


def zeros(
    *size: int, dtype: tf.DType | None = None, device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None, requires_grad: bool = False,
) -> DTensor:
    """A DTensor of zeros of global shape ``size``.

    Example:
        >>> zeros(8, 4, device_mesh=mesh, placements=[Shard(0)]).placements
        (Shard(dim=0),)
    """
    return _make("zeros", tf.zeros, size, dtype, device_mesh, placements)


def ones(
    *size: int, dtype: tf.DType | None = None, device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None, requires_grad: bool = False,
) -> DTensor:
    """A DTensor of ones of global shape ``size``."""
    return _make("ones", tf.ones, size, dtype, device_mesh, placements)


def empty(
    *size: int, dtype: tf.DType | None = None, device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None, requires_grad: bool = False,
) -> DTensor:
    """A DTensor of global shape ``size`` (TF has no uninitialised memory: zeros)."""
    return _make("empty", tf.zeros, size, dtype, device_mesh, placements)


def full(
    size: Sequence[int], fill_value: float, *, dtype: tf.DType | None = None,
    device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor of global shape ``size`` filled with ``fill_value``."""

    def make(shape, dtype):
        return tf.fill(shape, tf.cast(fill_value, dtype))

    return _make("full", make, (tuple(size),), dtype, device_mesh, placements)


def _random_seed() -> tf.Tensor:
    # A fresh seed pair per call from TF's global generator, so successive
    # calls differ and tf.random.set_seed makes them reproducible.
    return tf.random.get_global_generator().make_seeds(1)[:, 0]


def rand(
    *size: int, dtype: tf.DType | None = None, device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None, requires_grad: bool = False,
) -> DTensor:
    """Uniform [0, 1) values of global shape ``size``."""
    seed = _random_seed()

    def make(shape, dtype):
        return tf.random.stateless_uniform(shape, seed=seed, dtype=dtype)

    return _make("rand", make, size, dtype, device_mesh, placements, per_shard=False)


def randn(
    *size: int, dtype: tf.DType | None = None, device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None, requires_grad: bool = False,
) -> DTensor:
    """Standard normal values of global shape ``size``."""
    seed = _random_seed()

    def make(shape, dtype):
        return tf.random.stateless_normal(shape, seed=seed, dtype=dtype)

    return _make("randn", make, size, dtype, device_mesh, placements, per_shard=False)
