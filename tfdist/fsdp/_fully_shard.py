"""fully_shard (torch.distributed.fsdp.fully_shard, FSDP2) for Keras 3 layers and models.

Each call groups the trainable variables of ``module`` that no FSDP child
has grouped already.  They are stored sharded over the data-parallel mesh
dim (TF DVariables with ``dp`` on one dim, other mesh dims -- tensor
parallel -- kept), so the optimizer's slots take the same layout and every
device holds 1/N of parameters, gradients and optimizer state.

Around the call of the layer that owns a parameter, the parameter is
all-gathered; the gather waits for the layer's input, so full parameters
exist only around their use.  ``Dense`` and ``EinsumDense`` compute their
product in ``sharded_einsum``: the gradient is reduce-scattered (the bytes
of torch's) and, with ``reshard_after_forward``, the full kernel is
gathered again in the backward instead of being kept alive from the
forward.  Any other layer reads its gathered parameters through the
backend's ``read_as``; TF then sums its gradient inside the consuming op
(an all-reduce) and FSDP keeps the local slice.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _registry
from tfdist.device_mesh import DeviceMesh, default_data_parallel_mesh
from tfdist.fsdp._collectives import ShardedParam
from tfdist.fsdp._fsdp_module import FSDPModule, FSDPState, UnshardHandle, fsdp_class
from tfdist.fsdp._layer_calls import gathered_call, hook_layers, layer_call
from tfdist.fsdp._mesh_dims import DataParallelMeshDims, ShardPlacementResult, fsdp_meshes, placement_on
from tfdist.fsdp._offload import is_offloaded
from tfdist.fsdp._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from tfdist.fsdp._replica_groups import in_replica_group, replica_groups_call
from tfdist.tensor._modules import ModuleBackend, module_backend, replicate_unplaced
from tfdist.tensor.parallel.style import as_tf, batch_replicated
from tfdist.tensor.placement_types import Shard

__all__ = ["fully_shard", "FSDPModule", "FSDPStyle", "UnshardHandle", "register_fsdp_forward_method"]


def _check_args(module: Any, mesh: DeviceMesh, reshard_after_forward: Any, mp_policy: Any, offload_policy: Any,
                path: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard(mesh=...) must be a tfdist DeviceMesh. Received: {type(mesh).__name__}")
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            f"fully_shard({path!r}): reshard_after_forward must be a bool or an int. "
            f"Received: {reshard_after_forward!r}"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"fully_shard({path!r}): mp_policy must be a MixedPrecisionPolicy. Received: {mp_policy!r}"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(
            f"fully_shard({path!r}): offload_policy must be OffloadPolicy() or CPUOffloadPolicy(). "
            f"Received: {offload_policy!r}"
        )
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"fully_shard was already applied to {path!r}; apply it once per module, bottom-up "
            "(blocks first, then the model)."
        )


def _group_variables(modules: ModuleBackend, module: Any, ignored: set[int]) -> list[tuple[str, Any, str, Any]]:
    """(layer path, owning layer, weight name, variable) of the variables this call groups:
    trainable floating-point ones (a non-float parameter is kept whole, as torch 2.12's FSDP2
    does: it has no gradient to reduce-scatter), not in an FSDP child's group, not ignored."""
    taken: set[int] = set(ignored)
    out = []
    for path, layer in modules.named_layers(module):
        if layer is not module and isinstance(layer, FSDPModule):
            taken |= {id(v) for v in layer.fsdp_params}
    for path, layer in modules.named_layers(module):
        if not modules.is_built(layer):
            continue
        for name, variable in modules.weights(layer).items():
            if modules.is_trainable(variable) and tf.as_dtype(variable.dtype).is_floating and id(variable) not in taken:
                taken.add(id(variable))
                out.append((path or modules.layer_name(module), layer, name, variable))
    return out


_REPLICATE = object()  # shard_placement_fn that keeps every variable whole (FSDP1's NO_SHARD)


def _shard_dim(variable: Any, specs: list[str], mesh: DeviceMesh, replicate: DeviceMesh | None, fn: Callable | None,
               path: str) -> int | None:
    """The dim a variable is sharded on: ``shard_placement_fn``'s, else the first free dim that
    divides evenly (torch: dim 0); None leaves it replicated on dp."""
    shape, size = tuple(variable.shape), mesh.size()
    if fn is _REPLICATE:
        return None
    if fn is not None:
        placement = placement_on(fn(variable), mesh, replicate, f"{path}/{variable.name}")
        if placement is not None:
            if not isinstance(placement, Shard) or not -len(shape) <= placement.dim < len(shape):
                raise ValueError(
                    f"fully_shard: shard_placement_fn returned {placement!r} for {path}/{variable.name} of "
                    f"shape {shape}; expected Shard(d) with 0 <= d < {len(shape)}, or None."
                )
            d = placement.dim % len(shape)
            if specs[d] != dtensor.UNSHARDED or shape[d] % size:
                raise ValueError(
                    f"fully_shard: {path}/{variable.name} of shape {shape} cannot be sharded on dim {d} "
                    f"over {size} devices (already sharded on {specs[d]!r} or not divisible)."
                )
            return d
    return _shard_dim_of(shape, specs, size)


def _shard_dim_of(shape: tuple[int, ...], specs: list[str], size: int) -> int | None:
    """The first dim not sharded yet whose size divides evenly by ``size``."""
    for d, n in enumerate(shape):
        if specs[d] == dtensor.UNSHARDED and n % size == 0 and n >= size:
            return d
    return None


def fully_shard(
    module: Any,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    shard_placement_fn: Callable[[Any], Shard | ShardPlacementResult | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[Any] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shards a Keras layer's or model's parameters over the data-parallel devices (FSDP2).

    Apply it bottom-up: each call groups the trainable variables of
    ``module`` not grouped by an earlier call on a sublayer.  The module must
    be built.  Returns the module, whose class is now also ``FSDPModule``.

    Args:
        module: a built Keras layer or model (or a list of them, each sharded).
        mesh: a 1-D mesh (all devices when None), or the dp slice of a 2-D
            ``(dp, tp)`` mesh whose tp dim a tensor-parallel plan already uses.
        reshard_after_forward: True frees full parameters after use and
            gathers again in the backward; False keeps the forward's copy
            for the backward.  An int is treated as True.
        shard_placement_fn: ``variable -> Shard(d) | ShardPlacementResult |
            None``; default: the first dim that divides evenly by the mesh
            size (dim 0 for most weights); a variable with none stays
            replicated.  A ``ShardPlacementResult`` (torch 2.13's
            per-parameter mesh) must name the group's own dp dim.
        mp_policy: parameter, reduction and output dtypes.
        offload_policy: ``OffloadPolicy()``, or ``CPUOffloadPolicy()``: the shards,
            their gradients and optimizer state live on the host mesh between
            steps, copied to the devices for each forward/backward; the
            optimizer step runs on the host (not with HSDP; see docs/fsdp.md).
        ignored_params: variables to leave as they are.
        dp_mesh_dims: with ``mesh`` the full SPMD mesh, the dim to shard
            over (``DataParallelMeshDims(shard="dp")`` is ``mesh["dp"]``);
            a ``replicate`` dim (HSDP) is refused.

    Example::

        mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.compile(optimizer="adam", loss=...); model.fit(x, y, batch_size=64)
    """
    if isinstance(module, (list, tuple)):
        for m in module:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                        offload_policy=offload_policy, ignored_params=ignored_params, dp_mesh_dims=dp_mesh_dims)
        return module
    modules = module_backend(module, "fully_shard")
    path = modules.layer_name(module)
    mesh = mesh if mesh is not None else default_data_parallel_mesh()
    mesh, replicate = fsdp_meshes(mesh, dp_mesh_dims, path) if isinstance(mesh, DeviceMesh) else (mesh, None)
    _check_args(module, mesh, reshard_after_forward, mp_policy, offload_policy, path)
    if isinstance(offload_policy, CPUOffloadPolicy) and replicate is not None:
        raise NotImplementedError(
            f"fully_shard({path!r}): CPUOffloadPolicy with HSDP (a {replicate.axis_names[0]!r} x "
            f"{mesh.axis_names[0]!r} mesh) is not built: each replica group's backward is a custom gradient "
            "of the variables it reads, and an offloaded parameter is read as its device copy, which that "
            "gradient does not reach. Use CPUOffloadPolicy() on a 1-D mesh (or with tensor parallelism), "
            "or OffloadPolicy() with HSDP.")
    if not modules.is_built(module):
        raise ValueError(
            f"fully_shard({path!r}): the module is not built, so its variables do not exist yet. "
            "Build it first: call it once on a batch (model(x[:1])) or model.build(input_shape)."
        )
    ignored = {id(v) for v in (ignored_params or ())}
    group = _group_variables(modules, module, ignored)
    state = FSDPState(mesh, bool(reshard_after_forward), mp_policy, offload_policy, replicate)
    root = mesh.root_mesh
    dp_dim = mesh.root_dims[0]
    dp, tf_mesh = root.axis_names[dp_dim], root.to_tf()
    plans = []
    for layer_path, layer, name, variable in group:  # decide everything before changing anything
        layout = modules.variable_layout(variable)
        if layout is not None and layout.mesh != tf_mesh:
            raise ValueError(
                f"fully_shard({path!r}): {layer_path}/{name} lives on another mesh ({layout.mesh}); "
                "parallelize and shard a model on one mesh (mesh['dp'] and mesh['tp'] of one 2-D mesh)."
            )
        specs = list(layout.sharding_specs) if layout is not None else [dtensor.UNSHARDED] * len(variable.shape)
        if dp in specs:
            raise ValueError(f"fully_shard({path!r}): {layer_path}/{name} is already sharded on {dp!r}.")
        d = _shard_dim(variable, specs, mesh, replicate, shard_placement_fn, layer_path)
        shard_specs = list(specs)
        if d is not None:
            shard_specs[d] = dp
        param = ShardedParam(dtensor.Layout(shard_specs, tf_mesh), dtensor.Layout(specs, tf_mesh), d, dp,
                             sync=state.grad_sync, order=state.order)
        plans.append((layer, name, variable, param))
    modules.attach_mesh(module, mesh, dp_dim if replicate is None else replicate.root_dims[0])
    for layer, name, variable, param in plans:
        modules.place_variable(variable, param.shard_layout)
        if isinstance(offload_policy, CPUOffloadPolicy):
            modules.offload_variable(variable, param.shard_layout)
        state.params.append((variable, param))
    replicate_unplaced(modules, module, mesh)
    hook_layers(modules, plans, state)
    if isinstance(offload_policy, CPUOffloadPolicy):
        _hook_offloaded_call(modules, module, path)
    if replicate is not None:
        _hook_replica_groups(modules, module, mesh, replicate)
    _hook_module_dtypes(modules, module, mp_policy)
    _registry.module(module).fsdp = state
    module.__class__ = fsdp_class(type(module))
    return module


class FSDPStyle:
    """``fully_shard`` as a layout-map value (``tfdist.keras.LayoutMap``).

    A variable whose path matches is stored sharded over the map's
    data-parallel mesh dim (``dim_name``; default: the mesh's first dim) on
    its first dim that divides evenly -- after ``tp_style``'s placement on
    the tensor-parallel dim, if given -- and its layer gathers and
    reduce-scatters as under ``fully_shard`` from its first call on.

    Example::

        layout_map = tfdist.keras.LayoutMap(mesh)          # mesh ("batch", "model")
        layout_map[".*mlp.*"] = FSDPStyle(tp_style=ColwiseParallel())
        layout_map[".*"] = FSDPStyle()
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    """

    def __init__(
        self, *, reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
        tp_style: Any = None, dim_name: str | None = None,
    ) -> None:
        if not isinstance(reshard_after_forward, (bool, int)):
            raise ValueError(f"FSDPStyle: reshard_after_forward must be a bool. Received: {reshard_after_forward!r}")
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise ValueError(f"FSDPStyle: mp_policy must be a MixedPrecisionPolicy. Received: {mp_policy!r}")
        self.reshard_after_forward, self.mp_policy = bool(reshard_after_forward), mp_policy
        self.tp_style, self.dim_name = tp_style, dim_name

    def __repr__(self) -> str:
        return f"FSDPStyle(tp_style={self.tp_style!r}, dim_name={self.dim_name!r})"

    def shard_dim(self, shape: tuple[int, ...], specs: list[str], size: int) -> int | None:
        """The dim the data-parallel mesh dim shards (None: none divides evenly)."""
        return _shard_dim_of(shape, specs, size)

    def attach(self, modules: ModuleBackend, layer: Any, mesh: DeviceMesh) -> None:
        """From its first call on, ``layer`` gathers its dp-sharded variables (``mesh``: the dp slice)."""
        own = _registry.module(layer)
        if own.fsdp_style is not None:
            return
        own.fsdp_style = self
        state = FSDPState(mesh, self.reshard_after_forward, self.mp_policy, OffloadPolicy())
        dp = mesh.root_mesh.axis_names[mesh.root_dims[0]]
        ready: list[Callable] = []

        def call(original, *args, **kwargs):
            if not ready:
                params = _params_sharded_on(modules, layer, dp)
                ready.append(layer_call(modules, layer, params, state)[0] if params else None)
            if ready[0] is None:
                return original(*args, **kwargs)
            return ready[0](original, *args, **kwargs)

        modules.replace_inner_call(layer, call)


def _params_sharded_on(modules: ModuleBackend, layer: Any, dp: str) -> dict[str, tuple[Any, ShardedParam]]:
    """The layer's trainable variables and how to gather them, when one of them is sharded on ``dp``
    (a variable no dim of which divides stays whole: a parameter of dim None)."""
    out, any_sharded = {}, False
    for name, variable in modules.weights(layer).items():
        layout = modules.variable_layout(variable)
        if layout is None or not modules.is_trainable(variable):
            continue
        specs = list(layout.sharding_specs)
        d = specs.index(dp) if dp in specs else None
        any_sharded |= d is not None
        full = list(specs)
        if d is not None:
            full[d] = dtensor.UNSHARDED
        out[name] = (variable, ShardedParam(layout, dtensor.Layout(full, layout.mesh), d, dp))
    return out if any_sharded else {}


def _hook_offloaded_call(modules: ModuleBackend, module: Any, path: str) -> None:
    """CPU offload: an eager call of the module copies its offloaded parameters (its own and its
    FSDP children's) to the device mesh for the call; inside tfdist's steps they are there already
    (``modules.device_copies_for_call``).  Not a replaced computation: the flag stays as it was."""
    replaced = _registry.module(module).call_replaced

    def call(original, *args, **kwargs):
        leaves = [as_tf(a) for a in tf.nest.flatten((args, kwargs))]
        if any(modules.is_symbolic(t) for t in leaves):
            return original(*args, **kwargs)
        offloaded = [v for v in modules.all_weights(module) if is_offloaded(v)]
        with modules.device_copies_for_call(offloaded, path):
            return original(*args, **kwargs)

    modules.replace_call(module, call)
    _registry.module(module).call_replaced = replaced


def _hook_replica_groups(modules: ModuleBackend, module: Any, shard: DeviceMesh, replicate: DeviceMesh) -> None:
    """HSDP: the module's call runs once per replica group (``replica_groups_call``), unless a
    replica group's program is being traced already (a nested HSDP module runs as plain FSDP over
    ``shard`` inside its parent's group), the batch is replicated (a last partial batch), or its
    rows do not split over the groups."""
    tf_mesh = shard.root_mesh.to_tf()
    r, s = replicate.axis_names[0], shard.axis_names[0]
    groups = replicate.size()

    def call(original, *args, **kwargs):
        leaves = [as_tf(leaf) for leaf in tf.nest.flatten(args[0])] if args else []
        if (not leaves or in_replica_group() or batch_replicated()
                or not all(isinstance(t, tf.Tensor) and not modules.is_symbolic(t) for t in leaves)
                or any(t.shape.rank in (None, 0) or t.shape[0] is None or t.shape[0] % groups for t in leaves)):
            return original(*args, **kwargs)
        x = tf.nest.pack_sequence_as(args[0], leaves)
        return replica_groups_call(lambda rows: original(rows, *args[1:], **kwargs), x,
                                   mesh=tf_mesh, replicate=r, shard=s)

    modules.replace_call(module, call)


def _hook_module_dtypes(modules: ModuleBackend, module: Any, mp: MixedPrecisionPolicy) -> None:
    """MixedPrecisionPolicy's casts at the module boundary."""
    cast_in = mp.param_dtype if mp.cast_forward_inputs else None
    if cast_in is None and mp.output_dtype is None:
        return

    def cast(tree, dtype):
        def one(x):
            t = as_tf(x)
            if isinstance(t, tf.Tensor) and not modules.is_symbolic(t) and t.dtype.is_floating and t.dtype != dtype:
                return tf.cast(t, dtype)
            return x

        return tf.nest.map_structure(one, tree)

    def before(args, kwargs):
        return (cast(args, cast_in), kwargs) if cast_in is not None else (args, kwargs)

    def after(outputs):
        return cast(outputs, mp.output_dtype) if mp.output_dtype is not None else outputs

    modules.wrap_call(module, before, after)


def register_fsdp_forward_method(module: Any, method_name: str) -> None:
    """Runs ``module.<method_name>`` with the module's parameters gathered, like its call.

    Example::

        register_fsdp_forward_method(model, "generate")
    """
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    modules = module_backend(module, "register_fsdp_forward_method")
    state = _registry.module(module).fsdp
    params = {f"{i}": (v, p) for i, (v, p) in enumerate(state.params)}
    wrapped = gathered_call(modules, params, state)
    setattr(module, method_name, lambda *a, **k: wrapped(method, *a, **k))
