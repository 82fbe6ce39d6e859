"""tfdist.tensor: DTensor, placements and their constructors (torch.distributed.tensor)."""

from tfdist.device_mesh import DeviceMesh, init_device_mesh
from tfdist.tensor import _dispatch  # noqa: F401  (registers TF API dispatch)
from tfdist.tensor._api import DTensor, distribute_tensor
from tfdist.tensor._factory import empty, full, ones, rand, randn, zeros
from tfdist.tensor._layout import compute_local_shape_and_global_offset
from tfdist.tensor._module import distribute_module
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "DTensor",
    "DeviceMesh",
    "init_device_mesh",
    "distribute_tensor",
    "distribute_module",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "compute_local_shape_and_global_offset",
]
