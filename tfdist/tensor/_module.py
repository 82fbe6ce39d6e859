"""distribute_module for Keras layers (torch.distributed.tensor.distribute_module)."""

from __future__ import annotations

from typing import Any, Callable

from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh, resolve_mesh
from tfdist.tensor._layout import normalize_placements, physical_layout
from tfdist.tensor.placement_types import Replicate

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
    import tfdist.keras  # noqa: F401  (DVariable-backed Keras variables)
    from tfdist.keras import _variables
    from tfdist.tensor.parallel import _keras_layers as kl

    mesh = resolve_mesh(device_mesh, "distribute_module")
    if not getattr(module, "built", False):
        raise ValueError(
            "distribute_module needs a built layer (its weights must exist): call it on "
            "an input or build(input_shape) first, or use parallelize_module, which also "
            f"handles unbuilt models. Received: {getattr(module, 'name', module)!r} (unbuilt)"
        )
    root = mesh.root_mesh
    plans = []
    for fqn, layer in kl.named_layers(module):
        if isinstance(layer, kl.Pending):
            continue
        wanted = partition_fn(fqn, layer, mesh) if partition_fn is not None else None
        own = kl.weight_names(layer)
        for name, placements in (wanted or {}).items():
            if name not in own:
                raise ValueError(
                    f"partition_fn returned weight {name!r} for layer {fqn or layer.name!r}, "
                    f"which has {sorted(own)}."
                )
            variable = own[name]
            rank = len(variable.shape)
            p = normalize_placements(tuple(placements), mesh, rank)
            full = [Replicate()] * root.ndim
            for d, q in zip(mesh.root_dims, p):
                full[d] = q
            layout = physical_layout(root, full, rank)
            _variables._check_divisible(variable, layout)
            plans.append((variable, layout))
    for variable, layout in plans:
        _variables.to_dvariable(variable, layout)
    for variable in module.variables:
        if not _variables.is_dtensor_variable(variable):
            _variables.to_dvariable(variable, dtensor.Layout.replicated(root.to_tf(), len(variable.shape)))
    if input_fn is not None or output_fn is not None:
        before = (lambda args, kwargs: (tuple(input_fn(module, args, mesh)), kwargs)) if input_fn else None
        after = (lambda outputs: output_fn(module, outputs, mesh)) if output_fn else None
        kl.wrap_call(module, before, after)
    return module
