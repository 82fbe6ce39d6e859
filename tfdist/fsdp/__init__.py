"""Fully sharded data parallel for Keras 3 on TF DTensor (torch.distributed.fsdp).

``fully_shard`` (FSDP2) shards each group's parameters over the
data-parallel devices; gradients are reduce-scattered and optimizer state
is sharded with its parameter.  ``FullyShardedDataParallel`` is torch's
FSDP1 API on top of it.
"""

from tfdist.fsdp._fsdp1 import FullyShardedDataParallel
from tfdist.fsdp._optim_state import OptimStateKeyType
from tfdist.fsdp._fully_shard import (
    FSDPModule, FSDPStyle, UnshardHandle, fully_shard, register_fsdp_forward_method,
)
from tfdist.fsdp._mesh_dims import DataParallelMeshDims, FSDPMeshInfo, ShardPlacementResult
from tfdist.fsdp._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from tfdist.fsdp.api import (  # FSDP1's configuration types, at torch's tfdist.fsdp.api path too
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = [
    "fully_shard",
    "FSDPModule",
    "FSDPStyle",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "ShardPlacementResult",
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
]
