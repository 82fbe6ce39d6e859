"""DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks) for
``tfdist.nn.parallel.DistributedDataParallel.register_comm_hook``."""

from tfdist.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook

__all__ = ["default_hooks", "post_localSGD_hook"]
