"""parallelize_module: apply a tensor-parallel plan to a Keras layer or model."""

from __future__ import annotations

from typing import Any

from tfdist.device_mesh import DeviceMesh, resolve_mesh
from tfdist.tensor._modules import Pending, module_backend, replicate_unplaced
from tfdist.tensor.parallel._plan import match_plan
from tfdist.tensor.parallel.style import ParallelStyle, _Context

__all__ = ["parallelize_module"]


def _batch_axis(mesh: DeviceMesh) -> int | None:
    """The data-parallel root mesh dim: the one dim of the root that ``mesh`` leaves out."""
    others = [d for d in range(mesh.root_mesh.ndim) if d not in mesh.root_dims]
    return others[0] if len(others) == 1 else None


def parallelize_module(
    module: Any,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> Any:
    """Applies tensor-parallel styles to a Keras layer/model and returns it.

    Args:
        module: a Keras layer or model, built or not.
        device_mesh: a 1-D mesh, or a 1-D slice of an N-D mesh
            (``mesh["tp"]``); the other dim of a 2-D mesh is then the
            data-parallel dim along which batches are split.
        parallelize_plan: one style for ``module`` itself, or a dict from
            layer paths (torch FQNs, ``*`` for one path segment, e.g.
            ``"blocks.*.mlp.up"``) to styles.  A key that matches no layer is
            an error (a silently replicated model is a known trap).
        src_data_rank: accepted for torch compatibility; weights are
            initialised once, unsharded, so every client holds the same values.

    Every other variable of the module (and variables created later: optimizer
    slots, metrics) is replicated on the mesh's root.

    Example::

        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {
            "blocks.*.mlp.up": ColwiseParallel(),
            "blocks.*.mlp.down": RowwiseParallel(),
        })
        model.compile(...); model.fit(x, y, batch_size=16)   # batches split over dp
    """
    del src_data_rank
    mesh = resolve_mesh(device_mesh, "parallelize_module")
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_module needs a 1-D mesh (or a 1-D slice such as mesh['tp']). "
            f"Received: device_mesh with {mesh.ndim} dims {mesh.axis_names}."
        )
    if parallelize_plan is None:
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        plan = {"": parallelize_plan}
    elif isinstance(parallelize_plan, dict):
        plan = dict(parallelize_plan)
        for key, style in plan.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(
                    f"parallelize_plan[{key!r}] must be a ParallelStyle (ColwiseParallel(), ...). "
                    f"Received: {style!r}"
                )
    else:
        raise TypeError(
            "parallelize_plan must be a ParallelStyle or a dict of layer path -> style. "
            f"Received: {type(parallelize_plan).__name__}"
        )
    modules = module_backend(module, "parallelize_module")
    batch_axis = _batch_axis(mesh)
    # Check the whole plan first: a bad plan changes nothing.
    matches = [
        (layer, style, _Context(mesh, batch_axis, fqn or modules.layer_name(module), modules))
        for fqn, layer, style in match_plan(modules, module, plan)
    ]
    for layer, style, ctx in matches:
        if not isinstance(layer, Pending):
            style._validate(layer, ctx)
    modules.attach_mesh(module, mesh, batch_axis)
    for layer, style, ctx in matches:
        if isinstance(layer, Pending):  # created when its parent builds
            modules.defer(layer, lambda sub, style=style, ctx=ctx: style._apply(sub, ctx))
        else:
            style._apply(layer, ctx)
    replicate_unplaced(modules, module, mesh)
    return module

