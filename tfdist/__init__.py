"""tfdist: the PyTorch distributed programming model on TensorFlow DTensor.

``import tfdist`` imports TensorFlow only; Keras and TensorFlow Probability
are imported by the submodules that need them.

Example:
    >>> import tfdist
    >>> tfdist.virtual_cpus(8)                       # before anything touches TF devices
    >>> mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    >>> x = tfdist.tensor.distribute_tensor(tf.ones((8, 8)), mesh, [Shard(0), Shard(1)])
"""

from __future__ import annotations

__version__ = "0.1.0"

from tfdist._quiet import quiet_import

with quiet_import():  # only the `tfdist` command is quieted (see tfdist/_quiet.py)
    import tensorflow  # noqa: F401

from tfdist import autograd, tensor
from tfdist._runtime import (
    barrier,
    destroy,
    destroy_process_group,
    get_rank,
    get_world_size,
    init_distributed,
    init_process_group,
    is_initialized,
    virtual_cpus,
)
from tfdist.device_mesh import DeviceMesh, init_device_mesh
from tfdist.nn.parallel._grad_bucket import GradBucket
from tfdist.tensor._factory import manual_seed
from tfdist._runtime import apply_launcher_devices as _apply_launcher_devices

_apply_launcher_devices()

__all__ = [
    "__version__",
    "virtual_cpus",
    "init_distributed",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "barrier",
    "destroy",
    "get_rank",
    "get_world_size",
    "DeviceMesh",
    "init_device_mesh",
    "tensor",
    "autograd",
    "manual_seed",
    "GradBucket",
]
