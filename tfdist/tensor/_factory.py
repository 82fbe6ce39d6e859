"""Factory functions: zeros, ones, empty, full, rand, randn directly on a mesh.

Every value is produced already sharded, each device making only its shard
with no communication: constants through ``dtensor.call_with_layout``,
random values through the sharding-invariant scheme of ``_random`` (the
same seed gives the same global tensor on any mesh, which TF DTensor's own
sharded random ops do not).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh, resolve_mesh
from tfdist.tensor import _random as _random_lib
from tfdist.tensor._api import DTensor
from tfdist.tensor._layout import DTensorSpec, normalize_placements
from tfdist.tensor._redistribute import redistribute_physical
from tfdist.tensor.placement_types import Placement

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


def _check_layout(layout: Any, caller: str) -> None:
    """torch's ``layout=`` argument: only torch's default, ``torch.strided``, has a TF meaning (a dense
    tensor); TF DTensor lays out no sparse or mkldnn tensors."""
    if layout is None or str(layout) in ("strided", "torch.strided"):
        return
    raise ValueError(f"{caller}: layout must be None or 'strided' (torch.strided, the dense default): TF DTensor "
                     f"shards dense tensors only. Received: layout={layout!r}")


def _make(caller: str, make, size: tuple, dtype, device_mesh, placements) -> DTensor:
    """Builds a constant value with ``make(shape, dtype)``, each device only its shard."""
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
    physical = dtensor.call_with_layout(make, spec.tf_layout, shape=spec.physical_shape, dtype=dtype)
    return DTensor._wrap(physical, spec)


def zeros(
    *size: int, dtype: tf.DType | None = None, layout: Any = None,
    device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor of zeros of global shape ``size``.

    Example:
        >>> zeros(8, 4, device_mesh=mesh, placements=[Shard(0)]).placements
        (Shard(dim=0),)
    """
    _check_layout(layout, "zeros")
    return _make("zeros", tf.zeros, size, dtype, device_mesh, placements)


def ones(
    *size: int, dtype: tf.DType | None = None, layout: Any = None,
    device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor of ones of global shape ``size``."""
    _check_layout(layout, "ones")
    return _make("ones", tf.ones, size, dtype, device_mesh, placements)


def empty(
    *size: int, dtype: tf.DType | None = None, layout: Any = None,
    device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor of global shape ``size`` (TF has no uninitialised memory: zeros)."""
    _check_layout(layout, "empty")
    return _make("empty", tf.zeros, size, dtype, device_mesh, placements)


def full(
    size: Sequence[int], fill_value: float, *, dtype: tf.DType | None = None, layout: Any = None,
    device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor of global shape ``size`` filled with ``fill_value``."""
    _check_layout(layout, "full")
    if isinstance(fill_value, (str, bytes)) or not (np.isscalar(fill_value) or np.ndim(fill_value) == 0):
        raise TypeError(f"full: fill_value must be a number (a scalar). Received: fill_value={fill_value!r}")

    def make(shape, dtype):
        return tf.fill(shape, tf.cast(fill_value, dtype))

    return _make("full", make, (tuple(size),), dtype, device_mesh, placements)


def manual_seed(seed: int) -> None:
    """Seeds tfdist's random factories, as ``torch.manual_seed`` seeds torch's.

    The same as ``tf.random.set_seed(seed)`` (which ``keras.utils.set_random_seed``
    calls too): after it, the sequence of ``rand``/``randn``/``randint`` calls
    gives the same global values again, on any mesh and placements.

    Example:
        >>> tfdist.manual_seed(1234); a = tfdist.tensor.randn(4, 2, device_mesh=mesh)
        >>> tfdist.manual_seed(1234); b = tfdist.tensor.randn(4, 2, device_mesh=mesh)
        >>> bool(tf.reduce_all(a.full_tensor() == b.full_tensor()))
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int. Received: seed={seed!r}")
    tf.random.set_seed(int(seed))
    _random_lib.reset_seed_states(lambda: (int(seed), 0))


def _random_seed() -> tuple[int, int]:
    """A fresh seed pair per call.

    With a global seed (``tf.random.set_seed``, ``tfdist.manual_seed``,
    ``keras.utils.set_random_seed``) the pair is TF's own (global seed, next
    operation seed), whose sequence set_seed restarts -- so the same calls give
    the same values, as TF's random ops do.  Without one, it comes from TF's
    global generator (different every run, like torch without manual_seed).
    """
    global_seed, op_seed = tf.compat.v1.random.get_seed(None)
    if global_seed is not None:
        return int(global_seed), int(op_seed)
    seeds = tf.random.get_global_generator().make_seeds(1)[:, 0].numpy()
    return int(seeds[0]), int(seeds[1])


def traced_seed_start() -> tuple[int, int]:
    """Where a mesh's seed counter for draws inside ``tf.function`` starts: (global seed, 0) when one is
    set, so the same traced draws give the same values on every mesh; else a fresh pair."""
    global_seed = context.global_seed()  # read without drawing an op seed (get_seed would advance TF's count)
    return (int(global_seed), 0) if global_seed is not None else _random_seed()


def _random(caller: str, draw, size, dtype, device_mesh, placements) -> DTensor:
    shape = _size(size, caller)
    mesh = resolve_mesh(device_mesh, caller)
    placements = normalize_placements(placements, mesh, len(shape))
    if any(p.is_partial() for p in placements):
        raise ValueError(f"{caller} cannot create Partial values. Received: placements={placements!r}")
    spec = DTensorSpec(mesh, placements, shape)
    dtype = tf.as_dtype(dtype or tf.float32)
    if not spec.multi_dims:
        return DTensor._wrap(draw(spec, _random_seed(), dtype), spec)
    # a dim over several mesh dims: drawn on its outermost mesh dim, then sliced locally
    outer = spec.outer_only()
    return DTensor._wrap(redistribute_physical(draw(outer, _random_seed(), dtype), outer, spec), spec)


def rand(
    *size: int, dtype: tf.DType | None = None, layout: Any = None,
    device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """Uniform [0, 1) values of global shape ``size``.

    The same seed gives the same global values on any mesh and placements;
    each device computes only its own shard (see ``_random``).
    """
    _check_layout(layout, "rand")
    return _random("rand", _random_lib.uniform, size, dtype, device_mesh, placements)


def randn(
    *size: int, dtype: tf.DType | None = None, layout: Any = None,
    device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """Standard normal values of global shape ``size`` (sharding-invariant, computed per shard)."""
    _check_layout(layout, "randn")
    return _random("randn", _random_lib.normal, size, dtype, device_mesh, placements)
