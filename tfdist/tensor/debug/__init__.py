"""Debugging and visibility tools for DTensor (torch.distributed.tensor.debug)."""

from tfdist.tensor.debug._comm_mode import CommDebugMode
from tfdist.tensor.debug._explain import explain_redistribute
from tfdist.tensor.debug._visualize_sharding import visualize_sharding

__all__ = ["CommDebugMode", "visualize_sharding", "explain_redistribute"]
