"""CPU offload (``CPUOffloadPolicy``, FSDP1 ``CPUOffload(offload_params=True)``): where shards live.

An offloaded parameter's shards are stored on the *host mesh* -- the mesh of
the host CPUs with the device mesh's shape, dims and layout -- so its optimizer
slots (made from its layout) live there too.  Each step the shards are copied
to the device mesh before the step and the gradient shards back after it, each
device's shard to its own host CPU and back (``copy_shards``).  The copies run
between the step programs, not inside them, because TF DTensor (2.21) cannot
move a sharded tensor between meshes inside a program
(``docs/tf_dtensor_repros/cross_mesh_sharded_copy.py``): only a replicated one
crosses, which would gather every shard.

How the device mesh's host mesh is chosen, by device type:

* GPU / TPU: TF DTensor's own ``Mesh.host_mesh()`` (its CPUs, one per device,
  the same device ids).
* CPU: the devices *are* host CPUs, and ``host_mesh()`` returns the mesh
  itself.  The host mesh is then a second mesh on the same CPUs under its own
  name, so the storage, the optimizer's program and the per-step copies take
  the same route as on an accelerator; the memory is the same memory.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _registry

__all__ = ["host_mesh", "is_host_mesh", "host_layout", "copy_shards", "record", "device_layout", "is_offloaded"]

_HOST_MESHES: dict[str, dtensor.Mesh] = {}


def host_mesh(mesh: dtensor.Mesh) -> dtensor.Mesh:
    """The host mesh of a device mesh: its shape and dim names on host CPUs (see the module doc)."""
    key = mesh.to_string()
    if key not in _HOST_MESHES:
        if mesh.device_type().upper() == "CPU":
            _HOST_MESHES[key] = dtensor.Mesh(
                list(mesh.dim_names), mesh.global_device_ids(), mesh.local_device_ids(),
                mesh.local_devices(), mesh_name=f"{mesh.name or 'mesh'}_host")
        else:
            _HOST_MESHES[key] = mesh.host_mesh()
    return _HOST_MESHES[key]


def is_host_mesh(mesh: dtensor.Mesh) -> bool:
    """``mesh`` is the host mesh of a device mesh that offloaded parameters use."""
    return any(mesh == host for host in _HOST_MESHES.values())


def host_layout(layout: dtensor.Layout) -> dtensor.Layout:
    """``layout``'s sharding on its mesh's host mesh."""
    return dtensor.Layout(list(layout.sharding_specs), host_mesh(layout.mesh))


def copy_shards(value: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """``value`` (a DTensor) on ``layout``, a layout with the same shardings on a mesh of the same
    shape: each of this client's shards copied to the device at its coordinates.  Runs eagerly,
    between step programs (the module doc says why no program can do it)."""
    source = dtensor.fetch_layout(value)
    if list(source.sharding_specs) != list(layout.sharding_specs):
        raise ValueError(f"copy_shards: the layouts must shard alike; got {source.sharding_specs} and "
                         f"{layout.sharding_specs}")
    shards = dtensor.unpack(value)
    copies = []
    for shard, device in zip(shards, layout.mesh.local_devices()):
        with tf.device(device):
            copies.append(tf.identity(shard))
    return dtensor.pack(copies, layout)


def record(variable: Any, device: dtensor.Layout) -> None:
    """``variable`` (a framework variable) is stored on the host mesh; ``device`` is the layout of
    its per-step device copy."""
    _registry.variable(variable).device_layout = device


def device_layout(variable: Any) -> dtensor.Layout | None:
    """The device layout of an offloaded variable's step copy; None if it is not offloaded."""
    state = _registry.variable_if_any(variable)
    return state.device_layout if state is not None else None


def is_offloaded(variable: Any) -> bool:
    return device_layout(variable) is not None
