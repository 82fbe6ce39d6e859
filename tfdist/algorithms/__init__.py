"""``tfdist.algorithms`` (torch.distributed.algorithms): DDP communication hooks and model averaging."""

from tfdist.algorithms import _comm_hooks, ddp_comm_hooks, model_averaging

__all__ = ["ddp_comm_hooks", "model_averaging"]
