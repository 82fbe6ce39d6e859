"""torch.distributed.fsdp.api: FSDP1's configuration types at torch's module path.

They are defined where they act (``_fsdp1``, ``_state_dict``) and exported from
``tfdist.fsdp`` too; this module is the path torch code imports them from.

Example::

    from tfdist.fsdp.api import ShardingStrategy, StateDictType
"""

from tfdist.fsdp._fsdp1 import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from tfdist.fsdp._optim_state import OptimStateKeyType
from tfdist.fsdp._state_dict import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = [
    "BackwardPrefetch", "CPUOffload", "MixedPrecision", "ShardingStrategy", "StateDictType", "StateDictConfig",
    "FullStateDictConfig", "LocalStateDictConfig", "ShardedStateDictConfig", "OptimStateDictConfig",
    "FullOptimStateDictConfig", "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig", "StateDictSettings",
    "OptimStateKeyType",
]
