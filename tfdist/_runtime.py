"""Devices and clients: virtual CPUs, accelerator start-up, ranks.

TF DTensor runs one program over every device of a mesh.  A *client* is one
process; it owns the *local* devices, and the mesh spans the *global* devices
of all clients.  In a single process with 8 virtual CPUs there is one client
holding 8 local devices.  The multi-client environment (client id, number of
clients, job name, jobs list) is the one TF DTensor reads: ``DTENSOR_*``.
"""

from __future__ import annotations

import os

import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = [
    "virtual_cpus",
    "normalize_device_type",
    "detect_device_type",
    "local_devices",
    "num_global_devices",
    "get_rank",
    "get_world_size",
    "is_multi_client",
    "initialize_accelerators",
]

# torch spells the GPU "cuda"; TF DTensor spells device types in capitals.
_DEVICE_TYPES = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "tpu": "TPU"}

_initialized_device_type: str | None = None


def normalize_device_type(device_type: str) -> str:
    """Maps ``"cpu"``, ``"gpu"``/``"cuda"`` or ``"tpu"`` (any case) to TF's spelling.

    Raises:
        ValueError: for any other value.
    """
    if not isinstance(device_type, str) or device_type.lower() not in _DEVICE_TYPES:
        raise ValueError(
            "device_type must be one of 'cpu', 'gpu' (or 'cuda'), 'tpu'. "
            f"Received: device_type={device_type!r}"
        )
    return _DEVICE_TYPES[device_type.lower()]


def virtual_cpus(n: int = 8) -> list[str]:
    """Splits the host CPU into ``n`` logical devices, as a Colab user needs.

    Call it once, before anything else touches TensorFlow devices.  Calling it
    again with the same ``n`` is harmless.

    Args:
        n: number of logical CPU devices (>= 1).

    Returns:
        The names of the logical CPU devices.

    Raises:
        ValueError: ``n`` is not a positive int.
        RuntimeError: TensorFlow already initialised its devices with a
            different number of CPUs (restart the runtime and call this first).

    Example:
        >>> import tfdist
        >>> tfdist.virtual_cpus(8)[:2]
        ['/job:localhost/replica:0/task:0/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1']
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int. Received: n={n!r}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is None or len(configured) != n:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * n
            )
        except RuntimeError as err:
            have = len(tf.config.list_logical_devices("CPU"))
            if have != n:
                raise RuntimeError(
                    f"virtual_cpus({n}) came too late: TensorFlow has already "
                    f"initialised its devices with {have} logical CPU(s). Call "
                    "tfdist.virtual_cpus() first, before any TensorFlow op or "
                    "device query (in Colab: Runtime > Restart, then run it in "
                    "the first cell)."
                ) from err
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def detect_device_type() -> str:
    """The best device type present: TPU, then GPU, then CPU."""
    for kind in ("TPU", "GPU"):
        if tf.config.list_physical_devices(kind):
            return kind
    return "CPU"


def is_multi_client() -> bool:
    """True when the environment describes more than one DTensor client."""
    return int(os.environ.get("DTENSOR_NUM_CLIENTS", "1")) > 1


def get_rank() -> int:
    """This client's index (torch's rank when each process owns one device group)."""
    return int(os.environ.get("DTENSOR_CLIENT_ID", "0"))


def get_world_size() -> int:
    """Number of clients (processes) running the program."""
    return int(os.environ.get("DTENSOR_NUM_CLIENTS", "1"))


def initialize_accelerators(device_type: str) -> None:
    """Starts the accelerator system once for ``device_type`` where TF needs it.

    GPUs (NCCL collectives), TPUs (TPU system) and any multi-client setup need
    ``dtensor.initialize_accelerator_system``; a single CPU client does not.
    """
    global _initialized_device_type
    if _initialized_device_type is not None:
        return
    if device_type in ("GPU", "TPU") or is_multi_client():
        dtensor.initialize_accelerator_system(device_type)
    _initialized_device_type = device_type


def local_devices(device_type: str) -> list[str]:
    """Names of this client's logical devices of ``device_type``."""
    return [d.name for d in tf.config.list_logical_devices(device_type)]


def num_global_devices(device_type: str) -> int:
    """Devices of ``device_type`` over all clients."""
    if is_multi_client():
        return dtensor.num_global_devices(device_type)
    return len(local_devices(device_type))
