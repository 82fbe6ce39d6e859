"""Placements <-> TF DTensor layouts: the one converter (see docs/design.md).

Placements are mesh-major (one per mesh dim); a ``dtensor.Layout`` is
tensor-major (one sharding spec per tensor dim).  TF DTensor cannot express
two of torch's placements directly, so a DTensor is held as a *physical*
TF DTensor that encodes them:

* ``Partial`` on root mesh dim ``m``: a leading axis of size ``mesh.shape[m]``
  sharded on ``m`` (one per Partial mesh dim, in mesh-dim order).  Device
  ``i`` along ``m`` holds its partial value at index ``i``; reducing that
  axis (``tf.reduce_sum`` etc.) is the all-reduce that resolves it.
* Uneven ``Shard(d)`` (``n % k != 0``): dim ``d`` is padded at its end to
  ``ceil(n / k) * k`` and sharded evenly.  Device ``i`` then holds global
  rows ``[i*c, (i+1)*c)`` with ``c = ceil(n / k)``, which is exactly
  ``torch.chunk``; rows past ``n`` are padding that no result ever exposes.

Everything else maps one-to-one: ``Shard(d)`` on mesh dim ``m`` puts ``m``'s
name in the layout's entry ``d``, ``Replicate`` leaves it unsharded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor.placement_types import Placement, Replicate, Shard

__all__ = [
    "DTensorSpec",
    "normalize_placements",
    "compute_local_shape_and_global_offset",
    "chunk_size",
    "placements_from_tf_layout",
    "to_root_placements",
]


def chunk_size(n: int, k: int) -> int:
    """Rows per shard when ``n`` rows are split over ``k`` devices (torch.chunk)."""
    return -(-n // k)


def _shard_extent(n: int, k: int, index: int) -> tuple[int, int]:
    """(size, offset) of shard ``index`` of ``n`` rows over ``k`` devices."""
    c = chunk_size(n, k)
    start = min(index * c, n)
    return min(c, n - start), start


def normalize_placements(
    placements: Sequence[Placement] | None, mesh: DeviceMesh, ndim: int
) -> tuple[Placement, ...]:
    """Checks placements against a mesh and a tensor rank; makes Shard dims >= 0.

    Raises:
        ValueError / TypeError: with the argument, expectation and fix.
    """
    if placements is None:
        return (Replicate(),) * mesh.ndim
    if isinstance(placements, Placement) or not isinstance(placements, (list, tuple)):
        raise TypeError(
            "placements must be a list or tuple of Placement, one per mesh dim. "
            f"Received: placements={placements!r}"
        )
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        example = ", ".join(["Replicate()"] * (mesh.ndim - 1) + ["Shard(dim=0)"])
        raise ValueError(
            f"placements has {len(placements)} entries but the mesh has "
            f"{mesh.ndim} dims {mesh.axis_names}. Received: placements={placements!r}. "
            f"Give one placement per mesh dim, e.g. ({example},)."
        )
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(
                "each placement must be Shard(dim), Replicate() or Partial(). "
                f"Received: placements={placements!r}"
            )
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"Shard(dim={p.dim}) is out of range for a tensor with {ndim} "
                    f"dims (valid: {-ndim}..{ndim - 1}). Received: placements={placements!r}"
                )
            p = Shard(p.dim % ndim)
        out.append(p)
    sharded = [p.dim for p in out if isinstance(p, Shard)]
    if len(sharded) != len(set(sharded)):
        raise NotImplementedError(
            "sharding one tensor dim over several mesh dims is not supported: a "
            "TF DTensor layout shards each tensor dim over at most one mesh dim. "
            f"Received: placements={placements!r}. Shard different tensor dims, "
            "or flatten the mesh dims into one."
        )
    return tuple(out)


def to_root_placements(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    base: Sequence[Placement] | None = None,
) -> tuple[Placement, ...]:
    """Placements on ``mesh`` (a root mesh or a slice of one) as placements on its root.

    The root mesh dims that ``mesh`` leaves out keep their entry of ``base``
    (default: ``Replicate()``).  This is the one place that maps a slice's
    placements onto the root; every API that accepts ``mesh["tp"]`` uses it.
    """
    root = list(base) if base is not None else [Replicate()] * mesh.root_mesh.ndim
    for dim, p in zip(mesh.root_dims, placements):
        root[dim] = p
    return tuple(root)


@dataclasses.dataclass(frozen=True)
class DTensorSpec:
    """Mesh, placements and global shape of a DTensor, and its physical encoding.

    ``placements`` has one entry per dim of ``mesh`` (which may be a slice);
    ``root_placements`` extends it to the root mesh with ``Replicate``.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def root_placements(self) -> tuple[Placement, ...]:
        return to_root_placements(self.mesh, self.placements)

    @functools.cached_property
    def root_shape(self) -> tuple[int, ...]:
        return self.mesh.root_mesh.shape

    @functools.cached_property
    def shard_mesh_dims(self) -> dict[int, int]:
        """Tensor dim -> root mesh dim that shards it."""
        return {
            p.dim: m for m, p in enumerate(self.root_placements) if isinstance(p, Shard)
        }

    @functools.cached_property
    def partial_mesh_dims(self) -> tuple[int, ...]:
        """Root mesh dims holding Partial values (= the leading physical axes)."""
        return tuple(m for m, p in enumerate(self.root_placements) if p.is_partial())

    def padded_size(self, dim: int) -> int:
        """Physical size of tensor dim ``dim`` (padded when unevenly sharded)."""
        n = self.shape[dim]
        m = self.shard_mesh_dims.get(dim)
        if m is None:
            return n
        k = self.root_shape[m]
        return chunk_size(n, k) * k

    @functools.cached_property
    def uneven_dims(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if self.padded_size(d) != self.shape[d])

    @functools.cached_property
    def physical_shape(self) -> tuple[int, ...]:
        lead = tuple(self.root_shape[m] for m in self.partial_mesh_dims)
        return lead + tuple(self.padded_size(d) for d in range(len(self.shape)))

    @functools.cached_property
    def tf_layout(self) -> dtensor.Layout:
        return physical_layout(self.mesh.root_mesh, self.root_placements, len(self.shape))

    def local_shape_and_offset(
        self, root_coordinate: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Logical local shape and global offset of the device at a root coordinate."""
        shape, offset = list(self.shape), [0] * len(self.shape)
        for d, m in self.shard_mesh_dims.items():
            shape[d], offset[d] = _shard_extent(self.shape[d], self.root_shape[m], root_coordinate[m])
        return tuple(shape), tuple(offset)

    def __repr__(self) -> str:
        placements = ", ".join(str(p) for p in self.placements)
        return f"DTensorSpec(mesh={self.mesh.axis_names}, placements=({placements}), shape={self.shape})"


def physical_layout(
    root: DeviceMesh, root_placements: Sequence[Placement], ndim: int
) -> dtensor.Layout:
    """The TF layout of the physical encoding of ``root_placements``."""
    names = root.axis_names
    specs = [names[m] for m, p in enumerate(root_placements) if p.is_partial()]
    per_dim = [dtensor.UNSHARDED] * ndim
    for m, p in enumerate(root_placements):
        if isinstance(p, Shard):
            per_dim[p.dim] = names[m]
    return dtensor.Layout(specs + per_dim, root.to_tf())


def placements_from_tf_layout(layout: dtensor.Layout) -> tuple[Placement, ...]:
    """Placements (one per mesh dim) equal to a TF layout without encodings."""
    names = list(layout.mesh.dim_names)
    out: list[Placement] = [Replicate()] * len(names)
    for d, spec in enumerate(layout.sharding_specs):
        if spec == dtensor.UNSHARDED:
            continue
        if spec == dtensor.MATCH or spec not in names:
            raise ValueError(
                f"layout entry {d} is {spec!r}, which is not a mesh dim of "
                f"{names}. Received: layout={layout.to_string()!r}"
            )
        out[names.index(spec)] = Shard(d)
    return tuple(out)


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of one device's shard (torch's helper).

    Args:
        global_shape: the logical shape of the whole tensor.
        mesh: the DeviceMesh (or a slice of one).
        placements: one per dim of ``mesh``.
        coordinate: the device's coordinate on ``mesh``; default this
            client's first device.

    Example (size 6 over 4 devices follows torch.chunk: 2, 2, 2, 0):
        >>> mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b"))
        >>> [compute_local_shape_and_global_offset((6,), mesh["a"], [Shard(0)], [i])
        ...  for i in range(4)]
        [((2,), (0,)), ((2,), (2,)), ((2,), (4,)), ((0,), (6,))]
    """
    shape = tuple(int(s) for s in global_shape)
    placements = normalize_placements(placements, mesh, len(shape))
    spec = DTensorSpec(mesh, placements, shape)
    if coordinate is None:
        coordinate = mesh.get_coordinate()
    coordinate = list(coordinate)
    if len(coordinate) != mesh.ndim or any(
        not 0 <= c < s for c, s in zip(coordinate, mesh.shape)
    ):
        raise ValueError(
            f"coordinate must have one index per mesh dim within {mesh.shape}. "
            f"Received: coordinate={coordinate!r}"
        )
    root_coord = [0] * mesh.root_mesh.ndim
    for dim, c in zip(mesh.root_dims, coordinate):
        root_coord[dim] = c
    return spec.local_shape_and_offset(root_coord)


def num_elements(shape: Sequence[int]) -> int:
    return math.prod(shape)
