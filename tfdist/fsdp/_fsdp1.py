"""The FSDP1 API (torch.distributed.fsdp.FullyShardedDataParallel) on top of ``fully_shard``.

torch's ``FullyShardedDataParallel(module)`` wraps the module in a new one.
A Keras model must stay the object the user compiles and fits, so here the
call shards ``module`` in place (units chosen by ``auto_wrap_policy``, then
the root) and returns it; ``isinstance(model, FullyShardedDataParallel)`` is
True for it, and the FSDP1 methods (``clip_grad_norm_``, ``no_sync``...) are
on it.
"""

from __future__ import annotations

import contextlib
import enum
import math
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf

from tfdist import _registry, _runtime
from tfdist.device_mesh import DeviceMesh, default_data_parallel_mesh
from tfdist.fsdp._fsdp_module import (
    FSDPModule, fsdp_class, group_states, refuse_unsynced_hsdp, retrace_keras_steps,
)
from tfdist.fsdp._fully_shard import _REPLICATE, fully_shard
from tfdist.fsdp._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from tfdist.fsdp import _optim_state, _state_dict
from tfdist.fsdp._state_dict import StateDictSettings, StateDictType
from tfdist.tensor._modules import module_backend
from tfdist.tensor._api import client_0_value

__all__ = [
    "FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload",
]


class ShardingStrategy(enum.Enum):
    """What FSDP shards (torch's names)."""

    FULL_SHARD = 1
    SHARD_GRAD_OP = 2
    NO_SHARD = 3
    HYBRID_SHARD = 4
    _HYBRID_SHARD_ZERO2 = 5


class BackwardPrefetch(enum.Enum):
    """Accepted for torch compatibility: TF's executor orders the backward's all-gathers."""

    BACKWARD_PRE = 1
    BACKWARD_POST = 2


class MixedPrecision:
    """FSDP1's mixed precision: ``param_dtype``, ``reduce_dtype``; ``buffer_dtype`` and
    ``keep_low_precision_grads`` are accepted (Keras' non-trainable variables keep their dtype;
    gradients reach the optimizer in the variable's dtype).  ``_module_classes_to_ignore``
    (torch's default: its batch norms; here None means the framework's, Keras'
    ``BatchNormalization``): with an ``auto_wrap_policy``, each layer of these classes is its own
    unit in full precision, as torch wraps them.

    Example::

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         mixed_precision=MixedPrecision(param_dtype="bfloat16"))
    """

    def __init__(
        self, param_dtype: Any = None, reduce_dtype: Any = None, buffer_dtype: Any = None,
        keep_low_precision_grads: bool = False, cast_forward_inputs: bool = False,
        cast_root_forward_inputs: bool = True, _module_classes_to_ignore: Sequence[type] | None = None,
    ) -> None:
        self.policy = MixedPrecisionPolicy(param_dtype, reduce_dtype, None, cast_forward_inputs)
        self.root_policy = MixedPrecisionPolicy(param_dtype, reduce_dtype, None, cast_root_forward_inputs)
        self.param_dtype = param_dtype
        self.buffer_dtype, self.keep_low_precision_grads = buffer_dtype, keep_low_precision_grads
        if _module_classes_to_ignore is not None and not all(isinstance(c, type) for c in _module_classes_to_ignore):
            raise TypeError("MixedPrecision(_module_classes_to_ignore=...) must be layer classes. Received: "
                            f"{_module_classes_to_ignore!r}")
        self._module_classes_to_ignore = (None if _module_classes_to_ignore is None
                                          else tuple(_module_classes_to_ignore))


class CPUOffload:
    """``offload_params=True``: every unit's shards live on the host mesh (``CPUOffloadPolicy``).

    Example::

        model = FullyShardedDataParallel(model, device_mesh=mesh, cpu_offload=CPUOffload(offload_params=True))
    """

    def __init__(self, offload_params: bool = False) -> None:
        self.offload_params = offload_params


class _FSDP1Meta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _FSDP1Methods)


class _FSDP1Methods:
    """The FSDP1 instance methods, added to the class of every unit ``FullyShardedDataParallel`` makes."""

    def check_is_root(self) -> bool:
        """True for the module ``FullyShardedDataParallel`` was called on."""
        return _registry.module(self).fsdp1_root

    def register_comm_hook(self, state: object, hook: Callable[..., tf.Tensor]) -> None:
        """Every gradient FSDP reduces in this tree goes through ``hook(state, grad)``: ``grad`` is the
        stacked per-device gradient ``[N(dp), *shape]`` (row ``i``: device ``i``'s unreduced gradient,
        torch's per-rank gradient) and the hook returns the reduced gradient of the parameter's shape
        (torch's hook writes it into ``output``; TF returns it).  Call it on the root, once.  A
        layer FSDP cannot see inside keeps TF's all-reduce (no hook).

        Example::

            from tfdist.algorithms._comm_hooks import default_hooks
            model.register_comm_hook(default_hooks.LowPrecisionState(), default_hooks.fp16_compress_hook)
        """
        if not self.check_is_root():
            raise ValueError("register_comm_hook: call it on the root FullyShardedDataParallel module (torch "
                             "registers one hook for the whole tree).")
        if not callable(hook):
            raise ValueError(f"register_comm_hook(hook) must be callable. Received: hook={hook!r}")
        states = [s for unit in _fsdp1_units(self) for s in group_states(unit, recurse=False)]
        if any(s.grad_sync.comm_hook is not None for s in states):
            raise RuntimeError("register_comm_hook: a communication hook is already registered (torch allows one).")
        for s in states:
            s.grad_sync.comm_hook = (state, hook)
        retrace_keras_steps(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, grads: list) -> tf.Tensor:
        """Clips ``grads`` (the list ``tape.gradient`` returned, replaced in place) to a total
        ``norm_type``-norm of at most ``max_norm``; returns the total norm before clipping.

        Keras keeps no ``.grad`` on variables, so the gradients are passed in.  Sharded
        gradients are fine: the norm is the global one.  Inside ``model.fit`` use the
        optimizer's ``global_clipnorm`` instead.

        Example::

            grads = tape.gradient(loss, model.trainable_variables)
            total = model.clip_grad_norm_(1.0, grads=grads)
        """
        if not isinstance(grads, list):
            raise TypeError(f"clip_grad_norm_(grads=...) must be the list of gradients. Received: {type(grads).__name__}")
        norm_type = float(norm_type)
        present = [tf.convert_to_tensor(g) for g in grads if g is not None]
        if not present:
            return tf.constant(0.0)
        if math.isinf(norm_type):
            total = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(tf.cast(g, tf.float32))) for g in present]))
        else:
            parts = [tf.reduce_sum(tf.abs(tf.cast(g, tf.float32)) ** norm_type) for g in present]
            total = tf.add_n(parts) ** (1.0 / norm_type)
        scale = tf.minimum(1.0, float(max_norm) / (total + 1e-6))
        for i, g in enumerate(grads):
            if g is not None:
                grads[i] = tf.convert_to_tensor(g) * tf.cast(scale, g.dtype)
        return total

    def state_dict(self) -> dict[str, Any]:
        """Every weight by torch-style name (``blocks.0.mlp.up.kernel``), in the form set by
        ``FullyShardedDataParallel.state_dict_type`` (default: FULL, numpy arrays).

        Example::

            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                sd = model.state_dict()          # tfdist DTensors, no communication
        """
        settings = _settings_of(self)
        config = settings.state_dict_config
        if settings.state_dict_type == StateDictType.FULL_STATE_DICT and config.rank0_only and not _state_dict.is_writer():
            return {}
        return {name: _state_dict.export_value(v, settings) for name, v in _state_dict.named_weights(self).items()}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
        """Writes a ``state_dict()`` of the current type back; returns (missing, unexpected) names.

        Everything is checked before anything is written: a missing or extra
        name (with ``strict``) or a wrong shape raises and leaves the weights as they were.
        """
        settings = _settings_of(self)
        own = _state_dict.named_weights(self)
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name in own:
            value = state_dict.get(name)
            shape = getattr(value, "shape", None) if not isinstance(value, (list, tuple)) else None
            if shape is not None and tuple(shape) != tuple(own[name].shape):
                raise ValueError(
                    f"load_state_dict: {name!r} has shape {tuple(shape)}, the model's is {tuple(own[name].shape)}."
                )
        for name, variable in own.items():
            if name in state_dict:
                _state_dict.import_value(variable, state_dict[name], settings, name)
        return missing, unexpected

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, backward passes hold their gradients unreduced (no reduce-scatter) and
        give zero gradients; the first backward after it adds the held sums and reduces once
        (``FSDPModule.set_requires_gradient_sync(False)`` on every unit of this tree, restored on
        exit).  As there, a ``tf.function`` step keeps the setting it was traced with.

        Example::

            with model.no_sync():
                grads_fn(x0, y0)          # held, nothing reduced
            grads = grads_fn_synced(x1, y1)   # the sum over both micro-batches
        """
        states = [s for unit in _fsdp1_units(self) for s in group_states(unit, recurse=False)]
        refuse_unsynced_hsdp(states, "no_sync()")
        before = [s.grad_sync.enabled for s in states]
        for s in states:
            s.grad_sync.enabled = False
        retrace_keras_steps(self)
        try:
            yield
        finally:
            for s, enabled in zip(states, before):
                s.grad_sync.enabled = enabled
            retrace_keras_steps(self)


_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _check_hybrid_mesh(strategy: ShardingStrategy, device_mesh: DeviceMesh | None, name: str) -> None:
    """The hybrid strategies take torch's 2-D (replicate, shard) mesh; the others a 1-D one."""
    ndim = device_mesh.ndim if isinstance(device_mesh, DeviceMesh) else 1
    if (strategy in _HYBRID) != (ndim == 2):
        wanted = "a 2-D (replicate, shard) device_mesh" if strategy in _HYBRID else "a 1-D device_mesh"
        raise ValueError(f"FullyShardedDataParallel({name!r}): sharding_strategy={strategy} takes {wanted}. "
                         f"Received: device_mesh={device_mesh!r}")


def _strategy_args(strategy: ShardingStrategy) -> dict:
    if strategy in _HYBRID:  # HSDP: the mesh's replicate dim is fully_shard's (a 2-D mesh)
        return {"reshard_after_forward": strategy == ShardingStrategy.HYBRID_SHARD}
    if strategy == ShardingStrategy.NO_SHARD:  # DDP: every variable replicated, gradients all-reduced
        return {"reshard_after_forward": False, "shard_placement_fn": _REPLICATE}
    return {"reshard_after_forward": strategy == ShardingStrategy.FULL_SHARD}


def _chain_prefetch(modules, root: Any, units: list[Any], forward: bool, backward: BackwardPrefetch | None) -> None:
    """FSDP1's prefetch arguments as FSDP2's lists: the units in forward order (the root first,
    then its units as the model lists them), each prefetching the next one in the forward
    (``forward_prefetch``) and, in the backward, the one before it (the root's backward starts with
    its last layers, so the root prefetches the last unit) from the point ``backward_prefetch``
    names: the unit's output gradient (PRE), its input gradient (POST), or, with None, its
    reduce-scattered gradients (no prefetch: torch issues the next gather after them)."""
    position = {id(layer): i for i, (_, layer) in enumerate(modules.named_layers(root))}
    ordered = sorted(units, key=lambda u: position[id(u)])
    chain = [root] + ordered
    if forward:
        for a, b in zip(chain, chain[1:]):
            a.set_modules_to_forward_prefetch([b])
    if ordered:  # None: each unit's gather still follows the later unit's reduce-scatter, as torch issues it
        backward_chain = [root] + ordered[::-1]
        at = {BackwardPrefetch.BACKWARD_PRE: "pre", BackwardPrefetch.BACKWARD_POST: "post", None: "reduced"}[backward]
        for a, b in zip(backward_chain, backward_chain[1:]):
            a.set_modules_to_backward_prefetch([b])
            a._fsdp_state.order.backward_at = at


_UNIT_ARGS = {"sharding_strategy", "mixed_precision"}  # what a CustomPolicy dict may set per unit
_NO_TF_MEANING = {"backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params", "device_id",
                  "sync_module_states", "param_init_fn"}  # per unit: applied once, for the whole model


def _full_precision_classes(modules, mp: MixedPrecision) -> tuple[type, ...]:
    """The layer classes wrapped alone in full precision: ``_module_classes_to_ignore`` when a
    ``param_dtype`` is set (torch: ``_wrap_module_cls_individually`` with mixed precision off)."""
    if mp.param_dtype is None:
        return ()
    given = mp._module_classes_to_ignore
    return tuple(modules.batch_norm_classes() if given is None else given)


def _units(modules, module: Any, policy: Callable | None, full_precision: tuple[type, ...] = ()
           ) -> list[tuple[Any, dict]]:
    """The sublayers ``policy`` makes their own unit, children before parents, each with the FSDP1
    arguments it overrides (a ``CustomPolicy`` may return a dict); a layer of a
    ``full_precision`` class is a unit of its own without mixed precision."""
    if policy is None:
        return []
    layers = [layer for _, layer in modules.named_layers(module) if modules.is_built(layer)]
    grouped: set[int] = set()
    units = []
    for layer in reversed(layers[1:]):  # reverse pre-order: every sublayer before its parent
        own = [v for _, sub in modules.named_layers(layer) if modules.is_built(sub)
               for v in modules.weights(sub).values() if modules.is_trainable(v)]
        free = [v for v in own if id(v) not in grouped]
        numel = sum(int(math.prod(v.shape)) for v in free)
        decision = policy(module=layer, recurse=False, nonwrapped_numel=numel) if free else False
        if free and isinstance(layer, full_precision):
            decision = {"mixed_precision": MixedPrecision()}
        if decision:
            overrides = dict(decision) if isinstance(decision, dict) else {}
            unknown = set(overrides) - _UNIT_ARGS - _NO_TF_MEANING
            if unknown:
                raise ValueError(f"auto_wrap_policy: layer {modules.layer_name(layer)!r} got FSDP arguments "
                                 f"{sorted(unknown)}; a unit may set {sorted(_UNIT_ARGS | _NO_TF_MEANING)}.")
            units.append((layer, {k: v for k, v in overrides.items() if k in _UNIT_ARGS}))
            grouped |= {id(v) for v in free}
    return units


class FullyShardedDataParallel(metaclass=_FSDP1Meta):
    """FSDP1: shards ``module`` in place and returns it (see the module docstring).

    Args follow torch.  ``sharding_strategy``: FULL_SHARD (default; full
    parameters freed after use and gathered again in the backward),
    SHARD_GRAD_OP (kept until the backward), NO_SHARD (replicated, gradients
    all-reduced: DDP); HYBRID_SHARD and _HYBRID_SHARD_ZERO2 take a 2-D
    ``(replicate, shard)`` ``device_mesh`` (HSDP, as ``fully_shard``).  ``auto_wrap_policy``
    chooses sublayers that become their own unit (``ModuleWrapPolicy``,
    ``size_based_auto_wrap_policy``).  ``device_mesh`` is a 1-D mesh (all
    devices when None), 2-D for the hybrid strategies.  ``process_group`` must be None.
    ``param_init_fn(layer)`` is called on every layer that owns weights
    before sharding; ``sync_module_states=True`` gives every client client
    0's weights first (multi-client).  ``forward_prefetch`` and
    ``backward_prefetch`` order the all-gathers (each unit starts the next
    one's, as ``FSDPModule.set_modules_to_forward_prefetch`` does).
    ``limit_all_gathers``, ``use_orig_params`` and ``device_id`` have no TF
    meaning and are accepted (docs/fsdp.md says why).

    Example::

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
        model.compile(optimizer="adam", loss=...); model.fit(x, y)
    """

    def __new__(
        cls, module: Any, process_group: Any = None, sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None, auto_wrap_policy: Callable | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None, ignored_modules: Any = None, param_init_fn: Any = None,
        device_id: Any = None, sync_module_states: bool = False, forward_prefetch: bool = False,
        limit_all_gathers: bool = True, use_orig_params: bool = False, ignored_states: Any = None,
        device_mesh: DeviceMesh | None = None,
    ) -> Any:
        modules = module_backend(module, "FullyShardedDataParallel")
        name = modules.layer_name(module)
        if process_group is not None:
            raise ValueError(
                f"FullyShardedDataParallel({name!r}): process_group must be None in tfdist; pass "
                f"device_mesh (a 1-D DeviceMesh). Received: process_group={process_group!r}"
            )
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if not isinstance(strategy, ShardingStrategy):
            raise ValueError(
                f"FullyShardedDataParallel({name!r}): sharding_strategy must be a ShardingStrategy. "
                f"Received: {sharding_strategy!r}"
            )
        args = _strategy_args(strategy)
        _check_hybrid_mesh(strategy, device_mesh, name)
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise ValueError(f"FullyShardedDataParallel({name!r}): backward_prefetch must be a BackwardPrefetch or "
                             f"None. Received: backward_prefetch={backward_prefetch!r}")
        if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
            raise ValueError(f"FullyShardedDataParallel({name!r}): cpu_offload must be a CPUOffload or None. "
                             f"Received: cpu_offload={cpu_offload!r}")
        offload = CPUOffloadPolicy() if cpu_offload is not None and cpu_offload.offload_params else OffloadPolicy()
        if isinstance(module, FSDPModule):
            raise ValueError(f"FullyShardedDataParallel({name!r}): the module is already sharded with FSDP.")
        ignored = [v for m in (ignored_modules or ()) for v in modules.variables(m)]
        ignored += list(ignored_states or ())
        if param_init_fn is not None:
            _initialize_with(modules, module, param_init_fn, name)
        if sync_module_states:
            _sync_from_client_0(modules, module, device_mesh)
        mp = mixed_precision or MixedPrecision()
        units = _units(modules, module, auto_wrap_policy, _full_precision_classes(modules, mp))
        for unit, overrides in units:
            unit_mp = overrides.get("mixed_precision") or mp
            unit_strategy = overrides.get("sharding_strategy", strategy)
            _check_hybrid_mesh(unit_strategy, device_mesh, name)
            unit_args = _strategy_args(unit_strategy)
            fully_shard(unit, mesh=device_mesh, mp_policy=unit_mp.policy, ignored_params=ignored,
                        offload_policy=offload, **unit_args)
        fully_shard(module, mesh=device_mesh, mp_policy=mp.root_policy, ignored_params=ignored,
                    offload_policy=offload, **args)
        for layer in [unit for unit, _ in units] + [module]:
            layer.__class__ = fsdp_class(type(layer), (_FSDP1Methods,))
            _registry.module(layer).fsdp1_root = layer is module
        _chain_prefetch(modules, module, [unit for unit, _ in units], forward_prefetch, backward_prefetch)
        return module

    # what the returned units have, at torch's paths (FullyShardedDataParallel.no_sync, ...)
    check_is_root = _FSDP1Methods.check_is_root
    clip_grad_norm_ = _FSDP1Methods.clip_grad_norm_
    no_sync = _FSDP1Methods.no_sync
    register_comm_hook = _FSDP1Methods.register_comm_hook

    @staticmethod
    def set_state_dict_type(
        module: Any, state_dict_type: StateDictType, state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> StateDictSettings:
        """Sets the form of ``state_dict()`` for every FSDP1 unit under ``module``; returns the previous settings."""
        settings = _state_dict.make_settings(state_dict_type, state_dict_config, optim_state_dict_config)
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        for unit in _fsdp1_units(module):
            _registry.module(unit).state_dict_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: Any) -> StateDictSettings:
        """The settings of the FSDP1 units under ``module`` (ValueError if they differ)."""
        found = [_settings_of(u) for u in _fsdp1_units(module)]
        if any(s != found[0] for s in found[1:]):
            raise ValueError("get_state_dict_type: the FSDP units under this module have different settings.")
        return found[0] if found else _state_dict.default_settings()

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: Any, state_dict_type: StateDictType, state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> Iterator[None]:
        """Within the block, ``state_dict()`` of the units under ``module`` takes this form."""
        settings = _state_dict.make_settings(state_dict_type, state_dict_config, optim_state_dict_config)
        with _state_dict.settings_scope(_fsdp1_units(module), settings):
            yield

    @staticmethod
    def optim_state_dict(model: Any, optim: Any, optim_state_dict: Any = None, group: Any = None) -> dict:
        """The optimizer's slots by parameter name and slot (``{"state": {name: {"momentum": ...}},
        "param_groups": [hyper-parameters]}``), in the model's state-dict form."""
        return _optim_state.optim_state(model, optim, FullyShardedDataParallel.get_state_dict_type(model))

    @staticmethod
    def optim_state_dict_to_load(model: Any, optim: Any, optim_state_dict: dict, **kwargs: Any) -> dict:
        """Writes an ``optim_state_dict`` into ``optim``'s slots (Keras optimizers have no
        ``load_state_dict``) and returns it.  The optimizer must be built (one step, or
        ``optim.build(model.trainable_variables)``)."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        slots = _state_dict.slots_by_param(model, optim)
        given = optim_state_dict.get("state", {})
        missing = sorted(set(slots) - set(given))
        if missing:
            raise ValueError(f"optim_state_dict_to_load: no state for {missing[:5]}")
        for name, per_slot in slots.items():
            for slot, variable in per_slot.items():
                _state_dict.import_value(variable, given[name][slot], settings, f"{name}/{slot}")
        return optim_state_dict

    # FSDP1's optimizer-state family (tfdist/fsdp/_optim_state.py)
    full_optim_state_dict = staticmethod(_optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(_optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(_optim_state.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(_optim_state.scatter_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(_optim_state.flatten_sharded_optim_state_dict)
    rekey_optim_state_dict = staticmethod(_optim_state.rekey_optim_state_dict)

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: Any, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
        offload_to_cpu: bool = False, with_grads: bool = False,
    ) -> Iterator[None]:
        """Full parameters for inspection or change.

        A sharded TF DTensor variable already reads as its full (global)
        value everywhere -- ``layer.kernel.numpy()`` and ``assign`` work on
        the whole array -- so inside the block nothing needs gathering.
        ``writeback=False`` restores the parameters on exit.  ``with_grads``
        raises (Keras keeps no gradients on variables);
        ``rank0_only=True`` with ``writeback=True`` raises, as in torch.

        Example::

            with FullyShardedDataParallel.summon_full_params(model, writeback=False):
                model.layers[0].kernel.assign(np.zeros((16, 32)))   # undone on exit
        """
        if rank0_only and writeback:
            raise ValueError("summon_full_params: rank0_only=True with writeback=True is not supported (as in torch).")
        if with_grads:
            raise ValueError("summon_full_params(with_grads=True): Keras variables keep no gradients.")
        modules = module_backend(module, "summon_full_params")
        variables = [v for v in modules.variables(module) if modules.is_trainable(v)]
        saved = None if writeback else [tf.identity(modules.stored_value(v)) for v in variables]
        try:
            yield
        finally:
            if saved is not None:
                for variable, value in zip(variables, saved):
                    variable.assign(value)


def _initialize_with(modules, module: Any, param_init_fn: Callable, name: str) -> None:
    """torch calls ``param_init_fn`` on each module whose parameters are on the meta device; a Keras
    layer's weights always exist, so it is called on every layer of the tree that owns weights
    (parents before children, as torch visits them), before anything is sharded."""
    if not callable(param_init_fn):
        raise ValueError(f"FullyShardedDataParallel({name!r}): param_init_fn must be a callable taking a layer. "
                         f"Received: param_init_fn={param_init_fn!r}")
    for _, layer in modules.named_layers(module):
        if modules.is_built(layer) and modules.weights(layer):
            param_init_fn(layer)


def _sync_from_client_0(modules, module: Any, device_mesh: DeviceMesh | None) -> None:
    """Every weight not yet on a mesh takes client 0's value (torch: broadcast from rank 0), so
    clients that initialised differently shard one model.  One client: nothing to do."""
    if not _runtime.is_multi_client():
        return
    root = (device_mesh if device_mesh is not None else default_data_parallel_mesh()).root_mesh
    for variable in modules.variables(module):
        if modules.is_placed(variable):
            continue  # laid out already (e.g. tensor parallel first): built from each client's values
        variable.assign(client_0_value(variable.numpy(), root))


def _fsdp1_units(module: Any) -> list[Any]:
    modules = module_backend(module, "state_dict_type")
    return [layer for _, layer in modules.named_layers(module) if isinstance(layer, _FSDP1Methods)]


def _settings_of(unit: Any) -> StateDictSettings:
    return _registry.module(unit).state_dict_settings or _state_dict.default_settings()
