"""FSDP1's communication hooks (torch.distributed.algorithms._comm_hooks), for
``FullyShardedDataParallel.register_comm_hook``."""

from tfdist.algorithms._comm_hooks import default_hooks

__all__ = ["default_hooks"]
