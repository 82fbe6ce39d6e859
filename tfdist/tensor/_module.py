"""distribute_module for Keras layers (torch.distributed.tensor.distribute_module)."""

from __future__ import annotations

from typing import Any, Callable

from tfdist.device_mesh import DeviceMesh, resolve_mesh
from tfdist.tensor._layout import (
    normalize_placements,
    physical_layout,
    to_root_placements,
)
from tfdist.tensor._modules import Pending, module_backend, replicate_unplaced

__all__ = ["distribute_module"]


def distribute_module(
    module: Any,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, Any, DeviceMesh], Any] | None = None,
    input_fn: Callable[[Any, tuple, DeviceMesh], tuple] | None = None,
    output_fn: Callable[[Any, Any, DeviceMesh], Any] | None = None,
) -> Any:
    """Puts a (built) Keras layer's weights on a mesh and hooks its inputs/outputs.

    Args:
        module: a built Keras layer or model.
        device_mesh: the mesh; default the current one.
        partition_fn: called as ``partition_fn(name, layer, mesh)`` for the
            module and every sublayer (``name`` is its FQN).  Keras layers
            cannot swap their variables for new objects, so instead of
            torch's ``register_parameter`` it *returns* a dict from weight
            name (``"kernel"``) to placements on ``mesh``; weights it leaves
            out are replicated (torch's default too).
        input_fn: ``input_fn(module, inputs, mesh) -> inputs`` before each call.
        output_fn: ``output_fn(module, outputs, mesh) -> outputs`` after it.

    Returns:
        The module, its weights all ``dtensor.DVariable``s on ``mesh``.

    Example::

        def shard_kernels(name, layer, mesh):
            if isinstance(layer, keras.layers.Dense):
                return {"kernel": [Shard(1)]}

        distribute_module(model, mesh, shard_kernels)
    """
    mesh = resolve_mesh(device_mesh, "distribute_module")
    modules = module_backend(module, "distribute_module")
    if not modules.is_built(module):
        raise ValueError(
            "distribute_module needs a built layer (its weights must exist): call it on "
            "an input or build(input_shape) first, or use parallelize_module, which also "
            f"handles unbuilt models. Received: {getattr(module, 'name', module)!r} (unbuilt)"
        )
    root = mesh.root_mesh
    plans = []
    for fqn, layer in modules.named_layers(module):
        if isinstance(layer, Pending):
            continue
        wanted = partition_fn(fqn, layer, mesh) if partition_fn is not None else None
        own = modules.weights(layer)
        for name, placements in (wanted or {}).items():
            if name not in own:
                raise ValueError(
                    f"partition_fn returned weight {name!r} for layer {fqn or modules.layer_name(layer)!r}, "
                    f"which has {sorted(own)}."
                )
            variable = own[name]
            rank = len(variable.shape)
            full = to_root_placements(mesh, normalize_placements(tuple(placements), mesh, rank))
            layout = physical_layout(root, full, rank)
            modules.check_layout(variable, layout)
            plans.append((variable, layout))
    for variable, layout in plans:
        modules.place_variable(variable, layout)
    replicate_unplaced(modules, module, mesh)
    if input_fn is not None or output_fn is not None:
        before = (lambda args, kwargs: (tuple(input_fn(module, args, mesh)), kwargs)) if input_fn else None
        after = (lambda outputs: output_fn(module, outputs, mesh)) if output_fn else None
        modules.wrap_call(module, before, after)
    return module
