"""``tfdist.nn``: torch.nn's distributed wrappers (``tfdist.nn.parallel.DistributedDataParallel``)."""

from tfdist.nn import parallel

__all__ = ["parallel"]
