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

import warnings
from typing import Any, Callable, Iterable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _registry
from tfdist.device_mesh import DeviceMesh, default_data_parallel_mesh
from tfdist.fsdp._collectives import (
    ShardedParam, gathered_with_sliced_grad, per_shard_call, sharded_einsum, sharded_lookup,
)
from tfdist.fsdp._gather_order import GatherOrder
from tfdist.fsdp._grad_sync import GradientSync
from tfdist.fsdp._offload import is_offloaded
from tfdist.fsdp._mesh_dims import DataParallelMeshDims, ShardPlacementResult, fsdp_meshes, placement_on
from tfdist.fsdp._replica_groups import in_replica_group, replica_groups_call
from tfdist.fsdp._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from tfdist.tensor._modules import ModuleBackend, module_backend, replicate_unplaced
from tfdist.tensor.parallel.style import as_tf, batch_replicated, on_mesh
from tfdist.tensor.placement_types import Shard

__all__ = ["fully_shard", "FSDPModule", "FSDPStyle", "UnshardHandle", "register_fsdp_forward_method"]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns; ``wait()`` returns at once."""

    def wait(self) -> None:
        """Nothing to wait for: see ``FSDPModule.unshard``."""


class FSDPModule:
    """Mixin that ``fully_shard`` adds to a layer's class (``FSDPDense``, ``FSDPSequential``...).

    Example::

        fully_shard(model)
        isinstance(model, FSDPModule)   # True
        model.set_reshard_after_backward(False)
    """

    @property
    def _fsdp_state(self) -> "_FSDPState":
        """This module's group (kept in ``tfdist._registry``, not on the module)."""
        return _registry.module(self).fsdp

    def reshard(self) -> None:
        """Full parameters exist only inside the step that uses them (TF frees a tensor after its
        last use), so there is nothing to free between steps: a no-op."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Inside a traced step: this module's forward all-gathers wait for nothing, so TF may
        run them from the step's start (torch issues them now).  Eagerly a no-op: TF runs each
        gather when its layer is called, and a sharded variable reads as its full value
        anywhere.  With ``async_op`` returns a handle whose ``wait()`` returns at once.

        Example::

            @tf.function
            def step(x):
                model.blocks[1].unshard()   # block 1's gathers overlap block 0's compute
                return model(x)
        """
        self._fsdp_state.order.unshard_now()
        return UnshardHandle() if async_op else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, the backward holds each gradient unreduced (the stacked per-device partial
        FSDP would reduce-scatter: no communication) and gives the parameter a zero gradient; the
        next backward with True adds the held sum and reduce-scatters once -- torch's gradient
        accumulation without a reduction per micro-batch.  ``recurse`` sets every FSDP module
        inside too.  A layer FSDP cannot see inside (the gathered route) still has its gradient
        all-reduced by TF's op; it is held as its local slice.

        The setting is read when the backward is built: inside a ``tf.function`` step, set it
        from a Python argument so each setting gets its own trace.

        Example::

            @tf.function
            def accumulate(x, y, sync):
                model.set_requires_gradient_sync(sync)
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x))
                return tape.gradient(loss, model.trainable_variables)

            for i, (x, y) in enumerate(micro_batches):
                grads = accumulate(x, y, sync=i == len(micro_batches) - 1)
            optimizer.apply(grads)   # the sum over the micro-batches
        """
        if not isinstance(requires_gradient_sync, (bool, int)):
            raise ValueError("set_requires_gradient_sync(requires_gradient_sync) must be a bool. "
                             f"Received: {requires_gradient_sync!r}")
        states = _group_states(self, recurse)
        if not requires_gradient_sync:
            refuse_unsynced_hsdp(states, "set_requires_gradient_sync(False)")
        for state in states:
            state.grad_sync.enabled = bool(requires_gradient_sync)
        _retrace_keras_steps(self)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """A no-op: full parameters never outlive the traced step in TF."""

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """A no-op: TF's executor finishes every pending reduction before the step returns."""

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """At the start of this module's forward, the listed modules' all-gathers may start: they
        wait for this module's input instead of their own layer's (TF's executor then runs them
        while this module computes), in the order listed.

        Example::

            for i, block in enumerate(model.blocks[:-1]):
                block.set_modules_to_forward_prefetch([model.blocks[i + 1]])
        """
        self._fsdp_state.order.forward_targets = _orders_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """At the start of this module's backward, the listed modules' backward all-gathers may
        start: they wait for this module's output gradient instead of their own layer's.

        Example::

            for i, block in enumerate(model.blocks[1:], 1):
                block.set_modules_to_backward_prefetch([model.blocks[i - 1]])
        """
        self._fsdp_state.order.backward_targets = _orders_of(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """The reduced gradient is the sum of the devices' gradients divided by ``factor``
        (torch's default divides by the data-parallel size ``N``, a mean).

        Keras losses already average over the global batch, so tfdist's gradient is torch's
        default; a factor ``f`` multiplies it by ``N / f`` (``f = 1``: the sum over devices).
        Applied to every parameter of the group, whatever its layer, where the reduced
        gradient shard meets the stored shard (before ``set_all_reduce_hook``'s hook, as torch).

        Example::

            model.set_gradient_divide_factor(1.0)  # sum the devices' gradients, do not average
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor(factor) must be a number > 0. Received: factor={factor!r}")
        self._fsdp_state.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch 2.13 for ``set_gradient_divide_factor``, which it calls."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor instead",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """torch: reduce with sums only, scaling in separate ops.  tfdist's reductions are sums
        already (the reduce-scatter is an all-to-all plus a local sum, the all-reduce TF's ``Add``)
        and a divide factor is a separate multiply, so both values run the same ops."""
        _check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        self._fsdp_state.force_sum_reduction = enable

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """torch 2.13: how many reduce-scatter input buffers may be in flight (a memory/overlap
        dial of its single copy-in buffer).  TF has no such buffer: each reduce-scatter's input
        is its own op output, allocated when computed and freed after the collective, and the
        executor overlaps collectives with compute as their inputs are ready; the value is
        checked and kept (``reduce_scatter_max_input_buffers``) but changes nothing."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for state in _group_states(self, recurse):
            state.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """torch 2.13: the reduce-scatter on its own process group (NCCL communicator), so it can
        overlap the backward's all-gathers.  On TF DTensor a collective's group is derived from
        the mesh and its reduced dims (one group key per device group, docs/design.md) and each
        collective op runs when its inputs are ready; a program has no communicator to choose.
        The setting is checked and kept (``separate_reduce_scatter_group``), with no effect."""
        _check_bool("set_separate_reduce_scatter_group", "enable", enable)
        for state in _group_states(self, recurse):
            state.separate_reduce_scatter_group = enable

    def set_all_reduce_hook(self, hook: Callable[[tf.Tensor], tf.Tensor | None], *, stream: Any = None) -> None:
        """Runs ``hook`` on each reduce-scattered gradient shard of this module's group, inside the
        traced step, before the optimizer sees it (torch: after the reduce-scatter, for a custom
        all-reduce or a gradient transform).  TF tensors are immutable, so the hook returns the
        new gradient (``None`` keeps it) where torch's modifies it in place; it gets and must
        return the shard's global shape and dtype.  ``stream`` (a CUDA stream in torch) has no TF
        meaning: TF's executor places the hook's ops.

        Example::

            model.set_all_reduce_hook(lambda grad: tf.clip_by_value(grad, -1.0, 1.0))
        """
        if not callable(hook):
            raise ValueError(f"set_all_reduce_hook(hook) must be callable. Received: hook={hook!r}")
        self._fsdp_state.all_reduce_hook = hook

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's all-reduce over the replicate dim runs in every backward; ``False`` (keep each
        replica group's gradient) is refused under HSDP, as gradient-sync off is, and is a no-op on
        a 1-D mesh (nothing to all-reduce)."""
        if not requires_all_reduce:
            refuse_unsynced_hsdp(_group_states(self, recurse), "set_requires_all_reduce(False)")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, the backward reuses the forward's full parameters instead of gathering again
        (``reshard_after_forward=False`` for this module)."""
        self._fsdp_state.regather_in_backward = bool(unshard_in_backward) and self._fsdp_state.reshard

    @property
    def fsdp_params(self) -> list[Any]:
        """The variables this module's group shards."""
        return [v for v, _ in self._fsdp_state.params]


class _FSDPState:
    """One group: its variables, how each is sharded, the policies."""

    def __init__(self, mesh: DeviceMesh, reshard: bool, mp: MixedPrecisionPolicy, offload: OffloadPolicy,
                 replicate: DeviceMesh | None = None) -> None:
        self.mesh = mesh
        self.replicate = replicate  # HSDP's replicate dim (a 1-D slice), else None
        self.reshard = reshard
        self.regather_in_backward = reshard
        self.mp = mp
        self.offload = offload
        self.params: list[tuple[Any, ShardedParam]] = []
        self.divide_factor: float | None = None
        self.force_sum_reduction = False
        self.reduce_scatter_max_input_buffers = 1
        self.separate_reduce_scatter_group = False
        self.all_reduce_hook: Callable[[tf.Tensor], tf.Tensor | None] | None = None
        self.grad_sync = GradientSync()
        self.order = GatherOrder()

    @property
    def data_parallel_size(self) -> int:
        """The devices a batch is split over (shard x replicate for HSDP): torch's default divisor."""
        return self.mesh.size() * (self.replicate.size() if self.replicate is not None else 1)


def _orders_of(modules: Any, method: str) -> list[GatherOrder]:
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, FSDPModule) for m in modules):
        raise ValueError(f"FSDPModule.{method}(modules) must be a list of FSDP modules (fully_shard applied). "
                         f"Received: {modules!r}")
    return [m._fsdp_state.order for m in modules]


def _retrace_keras_steps(module: Any) -> None:
    """A Keras model's cached train/test steps were traced with the old gradient-sync setting:
    dropped, so the next ``fit`` traces them again."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(module, name, None) is not None:
            setattr(module, name, None)


def refuse_unsynced_hsdp(states: list[_FSDPState], what: str) -> None:
    """Gradients held back per replica group are not built (``GradientSync`` says why)."""
    if any(state.replicate is not None for state in states):
        raise NotImplementedError(
            f"{what} under HSDP (a 2-D replicate x shard mesh): holding each replica group's unreduced "
            "gradients is not built. Use Keras' optimizer(gradient_accumulation_steps=k), or FSDP on a 1-D mesh.")


def _check_bool(method: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}({name}) must be a bool. Received: {name}={value!r}")


def _group_states(module: Any, recurse: bool) -> list[_FSDPState]:
    """The FSDP state of ``module`` and, with ``recurse``, of every FSDP module inside it."""
    if not recurse:
        own = _registry.module_if_any(module)
        return [own.fsdp] if own is not None and own.fsdp is not None else []
    modules = module_backend(module, "FSDPModule")
    found = (_registry.module_if_any(layer) for _, layer in modules.named_layers(module))
    return [own.fsdp for own in found if own is not None and own.fsdp is not None]


def _shard(modules: ModuleBackend, variable: Any, param: ShardedParam, state: _FSDPState) -> tf.Tensor:
    """The variable's stored shard.  Its gradient is the reduce-scattered shard (every FSDP path's
    custom gradient returns it for this value), so the group's all-reduce hook goes here, once
    for every kind of layer."""
    value = modules.stored_value(variable)
    if state.all_reduce_hook is not None:
        value = _hooked(value, state.all_reduce_hook, param.shard_layout)
    if state.divide_factor is not None:  # outside the hook: the backward scales first, as torch
        value = _scale_grad(value, state.data_parallel_size / state.divide_factor)
    return value


def _hooked(value: tf.Tensor, hook: Callable, layout: dtensor.Layout) -> tf.Tensor:
    @tf.custom_gradient
    def identity(v):
        def grad(dv):
            out = hook(dv)
            if out is None:
                return dv
            out = tf.convert_to_tensor(out)
            if out.shape != dv.shape or out.dtype != dv.dtype:
                raise ValueError(
                    f"set_all_reduce_hook: the hook must return the gradient shard's shape {dv.shape} and "
                    f"dtype {dv.dtype.name} (or None). Received: shape {out.shape}, dtype {out.dtype.name}")
            return dtensor.relayout(out, layout)

        return tf.identity(v), grad

    return identity(value)


_CLASSES: dict[tuple[type, tuple[type, ...]], type] = {}


def fsdp_class(cls: type, mixins: tuple[type, ...] = ()) -> type:
    """``FSDP<Name>``: the layer's class and FSDPModule (as torch's fully_shard does), plus ``mixins``."""
    if issubclass(cls, FSDPModule):  # adding mixins to a module already swapped
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    key = (cls, mixins)
    if key not in _CLASSES:
        _CLASSES[key] = _registry.swapped_class(f"FSDP{cls.__name__}", (cls, FSDPModule) + mixins, cls)
    return _CLASSES[key]


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
    state = _FSDPState(mesh, bool(reshard_after_forward), mp_policy, offload_policy, replicate)
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
    _hook_layers(modules, plans, state)
    if isinstance(offload_policy, CPUOffloadPolicy):
        _hook_offloaded_call(modules, module, path)
    if replicate is not None:
        _hook_replica_groups(modules, module, mesh, replicate)
    _hook_module_dtypes(modules, module, mp_policy)
    _registry.module(module).fsdp = state
    module.__class__ = fsdp_class(type(module))
    return module


def _hook_layers(modules: ModuleBackend, plans: list, state: _FSDPState) -> None:
    by_layer: dict[int, tuple[Any, dict[str, tuple[Any, ShardedParam]]]] = {}
    for layer, name, variable, param in plans:
        by_layer.setdefault(id(layer), (layer, {}))[1][name] = (variable, param)
    for layer, params in by_layer.values():
        call, inner = _layer_call(modules, layer, params, state)
        (modules.replace_inner_call if inner else modules.replace_call)(layer, call)


def _layer_call(modules: ModuleBackend, layer: Any, params: dict, state: _FSDPState) -> tuple[Callable, bool]:
    """The FSDP computation for ``layer`` and whether it replaces the innermost call."""
    if _is_plain_lookup(modules, layer, params):
        return _sharded_lookup_call(modules, layer, params, state), True
    if _runs_per_shard(modules, layer, params):
        return _per_shard_layer_call(modules, layer, params, state), True
    letters = _bias_letters(modules, layer, params)
    if letters is not None:
        return _sharded_product_call(modules, layer, params, state, letters), True
    # a tensor-parallel product that reads the weights itself is wrapped from outside
    return _gathered_call(modules, params, state), not modules.call_replaced(layer)


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
        state = _FSDPState(mesh, self.reshard_after_forward, self.mp_policy, OffloadPolicy())
        dp = mesh.root_mesh.axis_names[mesh.root_dims[0]]
        ready: list[Callable] = []

        def call(original, *args, **kwargs):
            if not ready:
                params = _params_sharded_on(modules, layer, dp)
                ready.append(_layer_call(modules, layer, params, state)[0] if params else None)
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


def _bias_letters(modules: ModuleBackend, layer: Any, params: dict) -> str | None:
    """The output letters a Dense/EinsumDense's bias covers, for a layer FSDP can compute as its
    einsum (``LayerKind.equation_for``); None for any other layer."""
    kind = modules.layer_kind(layer)
    if modules.call_replaced(layer) or not kind.plain:
        return None
    if not set(params) <= {"kernel", "bias"} or "kernel" not in params:
        return None
    if kind.kind == "dense":
        return "n"
    if kind.kind == "einsum":
        inp, ker, out = kind.einsum_parts()
        if "." in kind.equation or inp[0] in ker or inp[0] not in out or out[0] != inp[0]:
            return None
        if any(c not in out and c not in ker for c in inp):
            return None
        letters = ""
        if kind.bias_axes:
            first = min(out.index(c) for c in kind.bias_axes)
            letters = out[first:]
        return letters
    return None


def _sharded_product_call(
    modules: ModuleBackend, layer: Any, params: dict, state: _FSDPState, letters: str,
) -> Callable:
    """``letters``: the bias's output letters, decided once when the layer is hooked."""
    kernel_var, kernel_param = params["kernel"]
    bias = params.get("bias")
    kind = modules.layer_kind(layer)

    def call(original, inputs, *args, **kwargs):
        x = as_tf(inputs)
        if modules.is_symbolic(x) or not isinstance(x, tf.Tensor):
            return original(inputs, *args, **kwargs)
        equation = kind.equation_for(x.shape.rank)
        compute = state.mp.param_dtype or tf.as_dtype(kind.compute_dtype)
        bias_arg = None if bias is None else (_shard(modules, bias[0], bias[1], state), bias[1], letters)
        y = sharded_einsum(
            equation, x, _shard(modules, kernel_var, kernel_param, state), kernel_param,
            batch_sharded=_batch_splits(x, kernel_param),
            compute_dtype=compute, reduce_dtype=state.mp.reduce_dtype,
            regather=_regather(modules, kernel_var) if state.regather_in_backward else None,
            bias=bias_arg,
        )
        y = tf.cast(y, kind.compute_dtype)  # the layer's output dtype, whatever param_dtype computed
        return kind.activation(y) if kind.activation is not None else y

    return call


def _regather(modules: ModuleBackend, variable: Any) -> Callable[[], tf.Tensor]:
    """What the backward gathers again: the stored shard, read when the backward is built.  An
    eager backward runs after the call has returned, so it takes the shard the forward read (an
    offloaded parameter's device copy exists only during the call)."""
    if tf.executing_eagerly():
        shard = modules.stored_value(variable)
        return lambda: shard
    return lambda: modules.stored_value(variable)


def _batch_splits(x: tf.Tensor, param: ShardedParam) -> bool:
    """The batch (dim 0) is sharded over dp: not inside ``replicated_batch()`` and it divides evenly."""
    if batch_replicated() or x.shape.rank < 1:
        return False
    n = x.shape[0]
    return n is None or n % param.shard_layout.mesh.dim_size(param.dp) == 0


def _is_plain_lookup(modules: ModuleBackend, layer: Any, params: dict) -> bool:
    """An Embedding FSDP can look up itself (no LoRA, not quantized, a 2-D table)."""
    kind = modules.layer_kind(layer)
    if modules.call_replaced(layer) or not kind.plain:
        return False
    return kind.kind == "embedding" and set(params) == {"embeddings"} and len(
        params["embeddings"][0].shape) == 2


def _sharded_lookup_call(modules: ModuleBackend, layer: Any, params: dict, state: _FSDPState) -> Callable:
    table_var, table_param = params["embeddings"]
    kind = modules.layer_kind(layer)

    def call(original, inputs, *args, **kwargs):
        ids = as_tf(inputs)
        if modules.is_symbolic(ids) or not isinstance(ids, tf.Tensor) or ids.shape.rank == 0:
            return original(inputs, *args, **kwargs)
        ids = on_mesh(ids, state.mesh.root_mesh.to_tf())
        y = sharded_lookup(
            ids, _shard(modules, table_var, table_param, state), table_param,
            batch_sharded=_batch_splits(ids, table_param),
            compute_dtype=state.mp.param_dtype, reduce_dtype=state.mp.reduce_dtype,
        )
        return tf.cast(y, kind.compute_dtype)

    return call


def _runs_per_shard(modules: ModuleBackend, layer: Any, params: dict) -> bool:
    """A layer FSDP can run per data-parallel shard (``per_shard_call``): a norm, or any other
    leaf layer whose weights are all trainable FSDP parameters (no state a call could update,
    nothing TF's vectoriser would have to loop over)."""
    kind = modules.layer_kind(layer).kind
    if modules.call_replaced(layer) or kind not in ("norm", "other"):
        return False
    own = modules.weights(layer)
    if len(own) != len(params) or any(not modules.is_trainable(v) for v in own.values()):
        return False
    return all(child is layer for _, child in modules.named_layers(layer)) and not getattr(
        layer, "_seed_generators", None)


def _per_shard_layer_call(modules: ModuleBackend, layer: Any, params: dict, state: _FSDPState) -> Callable:
    """The layer's own computation run per data-parallel shard: its weight gradients are
    reduce-scattered (torch's bytes) where TF would all-reduce them.  A call with more than one
    tensor, a batch that does not split, or an op TF cannot vectorise takes the gathered route; so
    does a lookup (integer input): the gradient of TF's vectorised gather is a segment sum over the
    stacked copies that TF DTensor all-reduces whole (N x the table's bytes)."""
    pairs = list(params.values())
    gathered = _gathered_call(modules, params, state)
    vectorises = [True]
    parts = pairs[0][1].shard_layout.mesh.dim_size(pairs[0][1].dp)

    def call(original, inputs, *args, **kwargs):
        x = as_tf(inputs)
        extra = [a for a in tf.nest.flatten((args, kwargs)) if isinstance(as_tf(a), tf.Tensor)]
        if (not vectorises[0] or modules.is_symbolic(x) or not isinstance(x, tf.Tensor) or extra
                or not x.dtype.is_floating or x.shape.rank in (None, 0) or not _batch_splits(x, pairs[0][1])
                or parts == 1):  # one data-parallel device: nothing to reduce
            return gathered(original, inputs, *args, **kwargs)
        x = on_mesh(x, state.mesh.root_mesh.to_tf())
        variables = [v for v, _ in pairs]

        def fn(x_i, fulls):
            with modules.read_as([(v, tf.cast(f, v.dtype)) for v, f in zip(variables, fulls)]):
                return original(x_i, *args, **kwargs)

        try:
            return per_shard_call(
                fn, x, [_shard(modules, v, p, state) for v, p in pairs], [p for _, p in pairs],
                dtype=state.mp.param_dtype, reduce_dtype=state.mp.reduce_dtype,
            )
        except ValueError:  # an op with no vectorised form, or an output that is not row-wise
            vectorises[0] = False
            return gathered(original, inputs, *args, **kwargs)

    return call


def _scale_grad(y: tf.Tensor, scale: float) -> tf.Tensor:
    @tf.custom_gradient
    def scaled(y):
        return tf.identity(y), lambda dy: dy * tf.cast(scale, dy.dtype)

    return scaled(y)


def _gathered_call(modules: ModuleBackend, params: dict, state: _FSDPState) -> Callable:
    def call(original, *args, **kwargs):
        first = next((as_tf(a) for a in tf.nest.flatten((args, kwargs)) if isinstance(as_tf(a), tf.Tensor)), None)
        if first is not None and modules.is_symbolic(first):
            return original(*args, **kwargs)
        mesh = state.mesh.root_mesh.to_tf()
        args, kwargs = tf.nest.map_structure(  # eager host tensors join the parameters' mesh
            lambda a: on_mesh(a, mesh) if isinstance(a, tf.Tensor) else a, (args, kwargs)
        )
        values = [  # gathered in param_dtype (fewer bytes), read in the variable's dtype (Keras' rules)
            (variable, tf.cast(gathered_with_sliced_grad(_shard(modules, variable, param, state), param,
                                                         state.mp.param_dtype, first), variable.dtype))
            for variable, param in params.values()
        ]
        with modules.read_as(values):
            return original(*args, **kwargs)

    return call


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
    wrapped = _gathered_call(modules, params, state)
    setattr(module, method_name, lambda *a, **k: wrapped(method, *a, **k))
