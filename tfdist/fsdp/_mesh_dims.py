"""Which mesh dims FSDP uses: a 1-D mesh, HSDP's 2-D ``(replicate, shard)`` mesh, torch 2.13's
``DataParallelMeshDims`` (``fully_shard``'s ``dp_mesh_dims``) and per-parameter meshes
(``shard_placement_fn`` returning a ``ShardPlacementResult``).

FSDP shards over the mesh dim that shards the batch rows a group computes:
a parameter's gradient is the sum over those rows, reduce-scattered over
that dim.  HSDP adds one replicate dim (tfdist/fsdp/_replica_groups.py).
Names that would shard a group's rows over two mesh dims (a flattened
``shard`` tuple, a parameter's own mesh dim) are refused: a TF DTensor
layout names one mesh dim per tensor dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor.placement_types import Shard

__all__ = ["DataParallelMeshDims", "FSDPMeshInfo", "ShardPlacementResult", "fsdp_meshes", "placement_on"]

_TWO_DIMS = ("a group's batch rows would be sharded over two mesh dims, which a TF DTensor layout cannot "
             "express (docs/fsdp.md, Limits)")


def _names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"DataParallelMeshDims({field}=...) must be a mesh dim name or a tuple of names. "
                        f"Received: {field}={value!r}")
    return names


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """The data-parallel dims of a full SPMD mesh given to ``fully_shard(mesh=..., dp_mesh_dims=...)``.

    ``shard``: the mesh dim name FSDP shards parameters over (the batch's dim);
    ``replicate``: HSDP's replicate dim(s).  At least one must be set.

    Example::

        mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))  # == mesh["dp"]
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims. "
                             "Received: shard=None, replicate=None")
        _names(self.shard, "shard"), _names(self.replicate, "replicate")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard, "shard")

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate, "replicate")


@dataclasses.dataclass(frozen=True)
class FSDPMeshInfo:
    """A parameter's own FSDP mesh: ``mesh`` and the index of the dim to shard over (torch's
    ``FSDPMeshInfo``).  ``replicate_mesh_dim`` is HSDP's replicate dim."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"FSDPMeshInfo(mesh=...) must be a tfdist DeviceMesh. Received: {self.mesh!r}")
        if self.shard_mesh_dim is None and self.replicate_mesh_dim is None:
            raise ValueError("FSDPMeshInfo: at least one of shard_mesh_dim and replicate_mesh_dim must not be "
                             "None. Received: both None")
        for field in ("shard_mesh_dim", "replicate_mesh_dim"):
            dim = getattr(self, field)
            if dim is not None and not (isinstance(dim, int) and 0 <= dim < self.mesh.ndim):
                raise ValueError(f"FSDPMeshInfo({field}=...) must be a dim index of the {self.mesh.ndim}-D "
                                 f"mesh. Received: {field}={dim!r}")


@dataclasses.dataclass(frozen=True)
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to give a parameter its own mesh (torch 2.13):
    ``placement`` (``Shard(d)``, or None for the default dim) on ``mesh_info``'s shard dim."""

    placement: Shard | None
    mesh_info: FSDPMeshInfo


def fsdp_meshes(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None, path: str,
                ) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the 1-D mesh FSDP shards over, the 1-D replicate mesh of HSDP or None).

    A 2-D mesh is torch's HSDP mesh, ``(replicate, shard)``; ``dp_mesh_dims`` names the dims of
    a full mesh instead.  HSDP's mesh must have those two dims only (with tensor parallel, a
    third, it is not built)."""
    if dp_mesh_dims is None:
        if mesh.ndim == 1:
            return mesh, None
        if mesh.ndim != 2:
            raise ValueError(f"fully_shard({path!r}): mesh must be 1-D (FSDP) or 2-D (replicate, shard: HSDP). "
                             f"Received: a mesh with {mesh.ndim} dims {mesh.axis_names}.")
        replicate, shard = mesh.axis_names
    else:
        if not isinstance(dp_mesh_dims, DataParallelMeshDims):
            raise TypeError(f"fully_shard({path!r}): dp_mesh_dims must be a DataParallelMeshDims or None. "
                            f"Received: {dp_mesh_dims!r}")
        if not dp_mesh_dims.shard_names:
            raise ValueError(f"fully_shard({path!r}): dp_mesh_dims={dp_mesh_dims!r} asks for replicate-only data "
                             "parallelism; use DistributedDataParallel (or Keras' DataParallel).")
        for field, names in (("shard", dp_mesh_dims.shard_names), ("replicate", dp_mesh_dims.replicate_names)):
            if len(names) > 1:
                raise ValueError(f"fully_shard({path!r}): dp_mesh_dims.{field}={names!r} flattens {len(names)} mesh "
                                 f"dims: {_TWO_DIMS}. Give one mesh dim name.")
            if names and names[0] not in (mesh.mesh_dim_names or ()):
                raise ValueError(f"fully_shard({path!r}): dp_mesh_dims.{field}={names[0]!r} is not a dim of the mesh. "
                                 f"Expected one of {mesh.mesh_dim_names}.")
        shard = dp_mesh_dims.shard_names[0]
        replicate = dp_mesh_dims.replicate_names[0] if dp_mesh_dims.replicate_names else None
        if replicate is None:
            return mesh[shard], None
    if mesh.root_mesh.ndim != 2:
        raise ValueError(f"fully_shard({path!r}): HSDP over ({replicate!r}, {shard!r}) of a mesh with dims "
                         f"{mesh.root_mesh.axis_names}: HSDP with a third mesh dim (tensor parallel) is not built; "
                         "give a 2-D (replicate, shard) mesh.")
    return mesh[shard], mesh[replicate]


def _root_dim(mesh: DeviceMesh | None, dim: int | None) -> tuple | None:
    if mesh is None or dim is None:
        return None
    return mesh.root_mesh, mesh.root_dims[dim]


def placement_on(result: Any, shard: DeviceMesh, replicate: DeviceMesh | None, where: str) -> Any:
    """``shard_placement_fn``'s result for a parameter of the group that shards over ``shard`` (and
    replicates over ``replicate``, HSDP): a ``ShardPlacementResult`` naming those same mesh dims
    becomes its ``placement``; other dims are refused (the group's rows are sharded over
    ``shard`` only)."""
    if not isinstance(result, ShardPlacementResult):
        return result
    info = result.mesh_info
    own = (_root_dim(info.mesh, info.shard_mesh_dim), _root_dim(info.mesh, info.replicate_mesh_dim))
    group = (_root_dim(shard, 0), _root_dim(replicate, 0))
    if own != group:
        names = {"shard": info.shard_mesh_dim, "replicate": info.replicate_mesh_dim}
        asked = ", ".join(f"{k} {info.mesh.axis_names[d]!r}" for k, d in names.items() if d is not None)
        mine = f"shard {shard.axis_names[0]!r}" + (f", replicate {replicate.axis_names[0]!r}" if replicate else "")
        raise ValueError(
            f"fully_shard: shard_placement_fn gave {where} its own mesh dims ({asked} of {info.mesh!r}); tfdist "
            f"shards every parameter of a group over the dims that split the batch ({mine} of "
            f"{shard.root_mesh!r}); with others {_TWO_DIMS}.")
    return result.placement
