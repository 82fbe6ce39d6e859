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
* ``Shard(d)`` on several mesh dims ``m1 < ... < mr`` (torch's nesting: d is
  chunked over m1, each piece over m2, ...): dim ``d`` becomes ``r + 1``
  physical dims ``[k1, ..., kr, c]`` laid out ``(m1, ..., mr, unsharded)``,
  ``c`` the largest leaf chunk.  Entry ``[i1, ..., ir]`` is the leaf chunk of
  the device at those coordinates, padded to ``c``; ``leaf_index`` maps it to
  global rows (a static gather index, so building and reading it is one
  local ``tf.gather``).

Everything else maps one-to-one: ``Shard(d)`` on mesh dim ``m`` puts ``m``'s
name in the layout's entry ``d``, ``Replicate`` leaves it unsharded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np
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
    "nested_chunks",
]


MAX_PHYSICAL_RANK = 8


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
    return tuple(out)


def nested_chunks(n: int, ks: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, size) of every leaf when ``n`` rows are chunked over ``ks[0]``, each piece
    over ``ks[1]``, ... (torch.chunk at each level), leaves in row-major coordinate order."""
    leaves = [(0, n)]
    for k in ks:
        leaves = [(start + off, size) for start, n_piece in leaves
                  for size, off in (_shard_extent(n_piece, k, i) for i in range(k))]
    return leaves


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

    def __post_init__(self) -> None:
        # TF's CPU Pad/Slice kernels take rank <= 8; past it a DTensor op fails inside
        # TF and leaves the process unusable, so refuse it before anything runs.
        if len(self.physical_shape) > MAX_PHYSICAL_RANK:
            raise ValueError(
                f"a DTensor of rank {len(self.shape)} with these placements needs "
                f"{len(self.physical_shape)} physical dims, more than the {MAX_PHYSICAL_RANK} TensorFlow "
                "handles (each Partial mesh dim and each extra mesh dim on one tensor dim adds one). "
                f"Received: shape={self.shape}. Reshape to fewer dims first."
            )

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
    def shard_groups(self) -> dict[int, tuple[int, ...]]:
        """Tensor dim -> the root mesh dims that shard it, outermost (lowest) first."""
        groups: dict[int, tuple[int, ...]] = {}
        for m, p in enumerate(self.root_placements):
            if isinstance(p, Shard):
                groups[p.dim] = groups.get(p.dim, ()) + (m,)
        return groups

    @functools.cached_property
    def shard_mesh_dims(self) -> dict[int, int]:
        """Tensor dim -> root mesh dim, for dims sharded over exactly one mesh dim."""
        return {d: g[0] for d, g in self.shard_groups.items() if len(g) == 1}

    @functools.cached_property
    def multi_dims(self) -> tuple[int, ...]:
        """Tensor dims sharded over several mesh dims."""
        return tuple(sorted(d for d, g in self.shard_groups.items() if len(g) > 1))

    def _leaves(self, d: int) -> list[tuple[int, int]]:
        return nested_chunks(self.shape[d], [self.root_shape[m] for m in self.shard_groups[d]])

    def leaf_size(self, d: int) -> int:
        """The padded leaf chunk of a multi-mesh-dim dim (its last physical dim)."""
        return max(size for _, size in self._leaves(d))

    def leaf_index(self, d: int) -> np.ndarray:
        """For a multi-mesh-dim dim: int array ``[k1, ..., kr, c]`` of the global row each
        physical entry holds (``n`` marks padding)."""
        c = self.leaf_size(d)
        index = [[start + t if t < size else self.shape[d] for t in range(c)] for start, size in self._leaves(d)]
        ks = [self.root_shape[m] for m in self.shard_groups[d]]
        return np.asarray(index, dtype=np.int32).reshape(ks + [c])

    def piece_indices(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """For a multi-mesh-dim dim, the local index maps between one outer piece and its leaves.

        ``to_leaves[i]`` (``[K * c]``, K the inner devices) picks, from piece
        ``i`` padded to ``c1`` rows plus one pad row, the leaf chunks of its
        inner devices; ``to_piece[i]`` (``[c1]``) picks, from those leaves
        flattened plus one pad slot, the piece's rows back.
        """
        group = self.shard_groups[d]
        n, k1, inner = self.shape[d], self.root_shape[group[0]], [self.root_shape[m] for m in group[1:]]
        c1, c = chunk_size(n, k1), self.leaf_size(d)
        slots = math.prod(inner) * c
        to_leaves = np.full((k1, slots), c1, np.int32)
        to_piece = np.full((k1, c1), slots, np.int32)
        for i in range(k1):
            size_i, _ = _shard_extent(n, k1, i)
            for leaf, (off, size) in enumerate(nested_chunks(size_i, inner)):
                rows = np.arange(size)
                to_leaves[i, leaf * c + rows] = off + rows
                to_piece[i, off + rows] = leaf * c + rows
        return to_leaves, to_piece

    def outer_only(self) -> DTensorSpec:
        """This spec on the root mesh with each multi-mesh-dim dim sharded on its outermost
        mesh dim only (the form ops and redistribute work through)."""
        placements = tuple(
            Replicate() if isinstance(p, Shard) and p.dim in self.multi_dims and self.shard_groups[p.dim][0] != m
            else p
            for m, p in enumerate(self.root_placements)
        )
        return DTensorSpec(self.mesh.root_mesh, placements, self.shape)

    def physical_dims(self, d: int) -> int:
        """How many physical dims logical dim ``d`` occupies."""
        return len(self.shard_groups[d]) + 1 if d in self.multi_dims else 1

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
        shape = [self.root_shape[m] for m in self.partial_mesh_dims]
        for d in range(len(self.shape)):
            if d in self.multi_dims:
                shape += [self.root_shape[m] for m in self.shard_groups[d]] + [self.leaf_size(d)]
            else:
                shape.append(self.padded_size(d))
        return tuple(shape)

    @functools.cached_property
    def tf_layout(self) -> dtensor.Layout:
        return physical_layout(self.mesh.root_mesh, self.root_placements, len(self.shape))

    def local_shape_and_offset(
        self, root_coordinate: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Logical local shape and global offset of the device at a root coordinate."""
        shape, offset = list(self.shape), [0] * len(self.shape)
        for d, group in self.shard_groups.items():
            for m in group:  # torch.chunk at each level of the nesting
                size, start = _shard_extent(shape[d], self.root_shape[m], root_coordinate[m])
                shape[d], offset[d] = size, offset[d] + start
            if shape[d] == 0:  # torch places an empty shard at the end of the dim, at any nesting depth
                offset[d] = self.shape[d]
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
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    for m, p in enumerate(root_placements):
        if isinstance(p, Shard):
            per_dim[p.dim].append(names[m])
    for names_d in per_dim:
        # one mesh dim: the dim itself; several: one physical dim each, then the leaf
        specs += names_d if len(names_d) == 1 else names_d + [dtensor.UNSHARDED] if names_d else [dtensor.UNSHARDED]
    return dtensor.Layout(specs, root.to_tf())


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
