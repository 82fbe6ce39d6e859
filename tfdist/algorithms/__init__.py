"""``tfdist.algorithms`` (torch.distributed.algorithms): DDP communication hooks and model averaging."""

from tfdist.algorithms import ddp_comm_hooks, model_averaging

__all__ = ["ddp_comm_hooks", "model_averaging"]
