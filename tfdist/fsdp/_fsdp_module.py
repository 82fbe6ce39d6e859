"""``FSDPModule`` (torch's FSDP2 module API) and the state of one ``fully_shard`` group.

``fully_shard`` swaps a module's class for ``FSDP<Name>`` (its class and ``FSDPModule``), as torch
does; the module's group -- its sharded variables and policies -- is a ``FSDPState`` kept in
``tfdist._registry``, not on the module.  The ``set_*`` methods change that state; a setting a
traced step reads drops Keras' cached step functions so the next ``fit`` traces them again.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import tensorflow as tf

from tfdist import _registry
from tfdist.device_mesh import DeviceMesh
from tfdist.fsdp._collectives import ShardedParam
from tfdist.fsdp._gather_order import GatherOrder
from tfdist.fsdp._grad_sync import GradientSync
from tfdist.fsdp._policies import MixedPrecisionPolicy, OffloadPolicy
from tfdist.tensor._modules import module_backend

__all__ = ["FSDPModule", "FSDPState", "UnshardHandle", "fsdp_class", "group_states", "refuse_unsynced_hsdp",
           "retrace_keras_steps"]


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
    def _fsdp_state(self) -> "FSDPState":
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
        states = group_states(self, recurse)
        if not requires_gradient_sync:
            refuse_unsynced_hsdp(states, "set_requires_gradient_sync(False)")
        for state in states:
            state.grad_sync.enabled = bool(requires_gradient_sync)
        retrace_keras_steps(self)

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
        for state in group_states(self, recurse):
            state.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """torch 2.13: the reduce-scatter on its own process group (NCCL communicator), so it can
        overlap the backward's all-gathers.  On TF DTensor a collective's group is derived from
        the mesh and its reduced dims (one group key per device group, docs/design.md) and each
        collective op runs when its inputs are ready; a program has no communicator to choose.
        The setting is checked and kept (``separate_reduce_scatter_group``), with no effect."""
        _check_bool("set_separate_reduce_scatter_group", "enable", enable)
        for state in group_states(self, recurse):
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
            refuse_unsynced_hsdp(group_states(self, recurse), "set_requires_all_reduce(False)")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, the backward reuses the forward's full parameters instead of gathering again
        (``reshard_after_forward=False`` for this module)."""
        self._fsdp_state.regather_in_backward = bool(unshard_in_backward) and self._fsdp_state.reshard

    @property
    def fsdp_params(self) -> list[Any]:
        """The variables this module's group shards."""
        return [v for v, _ in self._fsdp_state.params]


class FSDPState:
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


def retrace_keras_steps(module: Any) -> None:
    """A Keras model's cached train/test steps were traced with the old gradient-sync setting:
    dropped, so the next ``fit`` traces them again."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(module, name, None) is not None:
            setattr(module, name, None)


def refuse_unsynced_hsdp(states: list[FSDPState], what: str) -> None:
    """Gradients held back per replica group are not built (``GradientSync`` says why)."""
    if any(state.replicate is not None for state in states):
        raise NotImplementedError(
            f"{what} under HSDP (a 2-D replicate x shard mesh): holding each replica group's unreduced "
            "gradients is not built. Use Keras' optimizer(gradient_accumulation_steps=k), or FSDP on a 1-D mesh.")


def _check_bool(method: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}({name}) must be a bool. Received: {name}={value!r}")


def group_states(module: Any, recurse: bool) -> list[FSDPState]:
    """The FSDP state of ``module`` and, with ``recurse``, of every FSDP module inside it."""
    if not recurse:
        own = _registry.module_if_any(module)
        return [own.fsdp] if own is not None and own.fsdp is not None else []
    modules = module_backend(module, "FSDPModule")
    found = (_registry.module_if_any(layer) for _, layer in modules.named_layers(module))
    return [own.fsdp for own in found if own is not None and own.fsdp is not None]


_CLASSES: dict[tuple[type, tuple[type, ...]], type] = {}


def fsdp_class(cls: type, mixins: tuple[type, ...] = ()) -> type:
    """``FSDP<Name>``: the layer's class and FSDPModule (as torch's fully_shard does), plus ``mixins``."""
    if issubclass(cls, FSDPModule):  # adding mixins to a module already swapped
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    key = (cls, mixins)
    if key not in _CLASSES:
        _CLASSES[key] = _registry.swapped_class(f"FSDP{cls.__name__}", (cls, FSDPModule) + mixins, cls)
    return _CLASSES[key]
