"""Debugging and visibility tools for DTensor (torch.distributed.tensor.debug)."""

from tfdist.tensor.debug._explain import explain_redistribute
from tfdist.tensor.debug._visualize_sharding import visualize_sharding

__all__ = ["visualize_sharding", "explain_redistribute"]
