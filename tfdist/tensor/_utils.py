"""torch.distributed.tensor._utils: where torch keeps compute_local_shape_and_global_offset."""

from tfdist.tensor._layout import compute_local_shape_and_global_offset

__all__ = ["compute_local_shape_and_global_offset"]
