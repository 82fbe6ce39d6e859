"""Which mesh dim FSDP shards over: torch 2.13's ``DataParallelMeshDims`` (``fully_shard``'s
``dp_mesh_dims``) and per-parameter meshes (``shard_placement_fn`` returning a
``ShardPlacementResult``).

tfdist's FSDP shards over the one mesh dim that also shards the batch: a
parameter's gradient is the sum over the batch rows, reduce-scattered over
that dim.  So every name here resolves to one data-parallel mesh dim, or is
refused with the reason: a second shard or replicate dim would need the batch
sharded over two mesh dims, which a TF DTensor layout cannot express (the
HSDP limit, docs/fsdp.md "Limits").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor.placement_types import Shard

__all__ = ["DataParallelMeshDims", "FSDPMeshInfo", "ShardPlacementResult", "fsdp_mesh", "placement_on"]

_TWO_DIMS = ("the batch would be sharded over two mesh dims, which a TF DTensor layout cannot express "
             "(docs/fsdp.md, Limits: HSDP)")


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


def fsdp_mesh(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None, path: str) -> DeviceMesh:
    """The 1-D data-parallel mesh ``fully_shard`` works on: ``mesh`` itself, or its ``shard`` slice."""
    if dp_mesh_dims is None:
        return mesh
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard({path!r}): dp_mesh_dims must be a DataParallelMeshDims or None. "
                        f"Received: {dp_mesh_dims!r}")
    if dp_mesh_dims.replicate_names:
        what = "HSDP" if dp_mesh_dims.shard_names else "replicate-only data parallelism (use DistributedDataParallel)"
        raise ValueError(f"fully_shard({path!r}): dp_mesh_dims={dp_mesh_dims!r} asks for {what} on the "
                         f"replicate dim(s) {dp_mesh_dims.replicate_names}: {_TWO_DIMS}. Give shard= only.")
    names = dp_mesh_dims.shard_names
    if len(names) != 1:
        raise ValueError(f"fully_shard({path!r}): dp_mesh_dims.shard={dp_mesh_dims.shard!r} flattens {len(names)} "
                         f"mesh dims: {_TWO_DIMS}. Give one mesh dim name.")
    if names[0] not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"fully_shard({path!r}): dp_mesh_dims.shard={names[0]!r} is not a dim of the mesh. "
                         f"Expected one of {mesh.mesh_dim_names}.")
    return mesh[names[0]]


def placement_on(result: Any, mesh: DeviceMesh, where: str) -> Any:
    """``shard_placement_fn``'s result for a parameter of the group on ``mesh`` (1-D): a
    ``ShardPlacementResult`` on that same mesh dim becomes its ``placement``; another mesh dim is
    refused (the batch is sharded over ``mesh``'s dim only)."""
    if not isinstance(result, ShardPlacementResult):
        return result
    info = result.mesh_info
    if info.replicate_mesh_dim is not None:
        raise ValueError(f"fully_shard: shard_placement_fn gave {where} a replicate mesh dim "
                         f"({info!r}), i.e. HSDP: {_TWO_DIMS}.")
    own = (info.mesh.root_mesh, info.mesh.root_dims[info.shard_mesh_dim])
    if own != (mesh.root_mesh, mesh.root_dims[0]):
        raise ValueError(
            f"fully_shard: shard_placement_fn gave {where} its own mesh dim "
            f"{info.mesh.axis_names[info.shard_mesh_dim]!r} of {info.mesh!r}; tfdist shards every parameter of "
            f"a group over the dim that shards the batch ({mesh.axis_names[0]!r} of {mesh.root_mesh!r}); with "
            f"another dim {_TWO_DIMS}.")
    return result.placement
