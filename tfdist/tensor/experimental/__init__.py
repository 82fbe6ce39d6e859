"""Experimental DTensor APIs (torch.distributed.tensor.experimental)."""

from tfdist.tensor.experimental._context_parallel import context_parallel
from tfdist.tensor.experimental._local_map import local_map
from tfdist.tensor.experimental._register_sharding import register_sharding

__all__ = ["local_map", "register_sharding", "context_parallel"]
