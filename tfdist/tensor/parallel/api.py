"""parallelize_module: apply a tensor-parallel plan to a Keras layer or model."""

from __future__ import annotations

from typing import Any

from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh, resolve_mesh
from tfdist.tensor.parallel import _keras_layers as kl
from tfdist.tensor.parallel.style import ParallelStyle, _Context

__all__ = ["parallelize_module"]


def _batch_axis(mesh: DeviceMesh) -> int | None:
    """The data-parallel root mesh dim: the one dim of the root that ``mesh`` leaves out."""
    others = [d for d in range(mesh.root_mesh.ndim) if d not in mesh.root_dims]
    return others[0] if len(others) == 1 else None


def _ensure_distribution(mesh: DeviceMesh, batch_axis: int | None) -> None:
    """Makes later variables (optimizer slots, metrics) live on the same mesh."""
    from keras.src.distribution import distribution_lib

    from tfdist.keras._backend import tfdist_mesh
    from tfdist.keras._distribution import MeshDistribution

    root = mesh.root_mesh
    current = distribution_lib.distribution()
    if current is not None:
        if tfdist_mesh(current.device_mesh).to_tf() != root.to_tf():
            raise ValueError(
                "the active keras distribution uses another mesh than device_mesh; "
                "parallelize under one mesh. Active: "
                f"{current.device_mesh}, device_mesh: {mesh!r}"
            )
        return
    name = root.axis_names[batch_axis] if batch_axis is not None else None
    distribution_lib.set_distribution(MeshDistribution(root, batch_dim_name=name))


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
    batch_axis = _batch_axis(mesh)
    # Check the whole plan first: a bad plan changes nothing.
    matches = [
        (layer, style, _Context(mesh, batch_axis, fqn or module.name))
        for fqn, layer, style in kl.match_plan(module, plan)
    ]
    for layer, style, ctx in matches:
        if not isinstance(layer, kl.Pending):
            style._validate(layer, ctx)
    _ensure_distribution(mesh, batch_axis)
    for layer, style, ctx in matches:
        if isinstance(layer, kl.Pending):  # created when its parent builds
            kl.defer(layer, lambda sub, style=style, ctx=ctx: style._apply(sub, ctx))
        else:
            style._apply(layer, ctx)
    _replicate_the_rest(module, mesh)
    if batch_axis is not None:
        module._tfdist_batch_dim = mesh.root_mesh.axis_names[batch_axis]
    return module


def _replicate_the_rest(module: Any, mesh: DeviceMesh) -> None:
    from tfdist.keras import _variables

    tf_mesh = mesh.root_mesh.to_tf()
    for variable in getattr(module, "variables", []):
        if not _variables.is_dtensor_variable(variable):
            _variables.to_dvariable(variable, dtensor.Layout.replicated(tf_mesh, len(variable.shape)))
