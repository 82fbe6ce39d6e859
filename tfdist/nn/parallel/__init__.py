"""``tfdist.nn.parallel``: ``DistributedDataParallel`` (torch.nn.parallel) for Keras models."""

from tfdist.nn.parallel._grad_bucket import GradBucket
from tfdist.nn.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradBucket"]
