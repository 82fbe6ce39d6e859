"""Distributed optimizers for Keras 3 on TF DTensor (torch.distributed.optim)."""

from tfdist.optim.distributed_optimizer import DistributedOptimizer
from tfdist.optim.post_localSGD_optimizer import PostLocalSGDOptimizer
from tfdist.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "PostLocalSGDOptimizer", "DistributedOptimizer"]
