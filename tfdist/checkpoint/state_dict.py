"""Model and optimizer state dicts keyed by canonical names (torch.distributed.checkpoint.state_dict).

A Keras model's canonical name of a weight is its layer path and weight name
(``blocks.0.mlp.up.kernel``), the same whether the model is plain, tensor
parallel, FSDP or both, so a state dict saved under one parallelism loads
under another.  The optimizer's state dict follows torch's shape::

    {"state": {"dense.kernel": {"momentum": ..., "velocity": ...}, ...},
     "param_groups": [{"params": ["dense.kernel", ...], "iterations": ..., "learning_rate": ...}]}

Values are tfdist ``DTensor`` s for sharded weights (no communication) or
tensors for unsharded ones; ``full_state_dict=True`` gathers whole tensors.
``tfdist.checkpoint.load`` fills such a dict in place; ``set_model_state_dict``
/ ``set_optimizer_state_dict`` then write it into the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _registry, _runtime
from tfdist.checkpoint._dist import Group
from tfdist.fsdp import _state_dict as _weights
from tfdist.tensor._api import DTensor, distribute_tensor
from tfdist.tensor._modules import module_backend

__all__ = [
    "StateDictOptions", "get_state_dict", "get_model_state_dict", "get_optimizer_state_dict", "set_state_dict",
    "set_model_state_dict", "set_optimizer_state_dict",
]


@dataclasses.dataclass
class StateDictOptions:
    """How state dicts are returned and loaded.

    * ``full_state_dict``: whole tensors instead of shards (gathered).
    * ``cpu_offload``: values as host numpy arrays; with ``full_state_dict``
      only rank 0 gets them (others get ``{}``), as in torch.
    * ``ignore_frozen_params``: leave out the weights of frozen layers
      (``layer.trainable = False``); non-trainable statistics of trainable
      layers (batch-norm moving means: torch's buffers) stay.
    * ``strict``: setting a state dict with missing or unexpected keys raises.
    * ``broadcast_from_rank0``: when setting a full state dict, rank 0's values
      are sent to every client (the others may pass ``{}``).
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _options(options: StateDictOptions | None) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a StateDictOptions. Received: options={options!r}")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("StateDictOptions: broadcast_from_rank0=True needs full_state_dict=True (torch's rule).")
    return options


def _check_model(model: Any, api: str) -> None:
    try:
        module_backend(model, api)
    except Exception:
        raise TypeError(f"{api}: model must be a Keras model or layer. Received: {type(model).__name__}") from None
    if not getattr(model, "built", True) or not getattr(model, "weights", None):
        raise ValueError(f"{api}: the model has no weights yet; build it (call it once or model.build(shape)).")


def _frozen(model: Any) -> set[int]:
    modules = module_backend(model, "get_model_state_dict")
    return {id(v) for v in modules.frozen_weights(model)}


def _model_variables(model: Any, options: StateDictOptions) -> dict[str, Any]:
    named = _weights.named_weights(model)
    if options.ignore_frozen_params:
        frozen = _frozen(model)
        named = {k: v for k, v in named.items() if id(v) not in frozen}
    return named


def _export(variable: Any, options: StateDictOptions) -> Any:
    value = module_backend(variable, "get_state_dict").stored_value(variable)
    if dtensor.is_dtensor(value):
        dt = DTensor.from_tf(value)
        if options.full_state_dict:
            return dt.numpy() if options.cpu_offload else dt.full_tensor()
        if options.cpu_offload and dt.device_mesh.device_type != "cpu":
            raise ValueError(
                "cpu_offload with a sharded state dict on a GPU/TPU mesh: TF DTensor cannot move a sharded "
                "tensor to a host mesh without gathering it; use full_state_dict=True."
            )
        return dt
    return np.asarray(value) if options.cpu_offload else tf.identity(value)


def _rank0_only(options: StateDictOptions) -> bool:
    return options.full_state_dict and options.cpu_offload and _runtime.get_rank() != 0


def get_model_state_dict(model: Any, *, submodules: Any = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's weights by canonical name.

    Example::

        sd = get_model_state_dict(model)                       # DTensors where sharded
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    """
    options = _options(options)
    _check_model(model, "get_model_state_dict")
    if submodules is not None:
        raise ValueError("get_model_state_dict: submodules is deprecated in torch and not supported; pass None.")
    variables = _model_variables(model, options)
    if _rank0_only(options):
        for v in variables.values():  # the gathers are collective: every client takes part
            _export(v, options)
        return {}
    return {name: _export(v, options) for name, v in variables.items()}


def _optimizers(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, Iterable) and not hasattr(optimizers, "apply"):
        return list(optimizers)
    return [optimizers]


def _ensure_built(model: Any, optim: Any) -> None:
    """Creates the optimizer's slots if no step ran yet (torch initialises optimizer state the same
    way), under the model's own distribution so they take their weights' layouts."""
    if getattr(optim, "built", False):
        return
    distribution = _registry.distribution_of(model)
    if distribution is None:
        optim.build(model.trainable_variables)
        return
    with distribution.scope():
        optim.build(model.trainable_variables)


def _optimizer_scalars(optim: Any) -> dict[str, Any]:
    return module_backend(optim, "get_optimizer_state_dict").optimizer_scalars(optim)


def get_optimizer_state_dict(model: Any, optimizers: Any, *, submodules: Any = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' slots by the canonical name of their weight (torch's ``{"state", "param_groups"}``).

    Example::

        osd = get_optimizer_state_dict(model, model.optimizer)
        osd["state"]["dense.kernel"]["momentum"]
    """
    options = _options(options)
    _check_model(model, "get_optimizer_state_dict")
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for optim in _optimizers(optimizers):
        _ensure_built(model, optim)
        slots = _weights.slots_by_param(model, optim)
        for name, per_slot in slots.items():
            state[name] = {slot: _export(v, options) for slot, v in per_slot.items()}
        group = {"params": sorted(slots)}
        group.update({k: _export(v, options) for k, v in _optimizer_scalars(optim).items()})
        groups.append(group)
    if _rank0_only(options):
        return {}
    return {"state": state, "param_groups": groups}


def get_state_dict(model: Any, optimizers: Any, *, submodules: Any = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``.

    Example::

        model_sd, optim_sd = get_state_dict(model, model.optimizer)
        tfdist.checkpoint.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    """
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def _assign(variable: Any, value: Any, name: str, options: StateDictOptions) -> None:
    if value is variable:
        return
    layout = module_backend(variable, "set_state_dict").variable_layout(variable)
    if isinstance(value, DTensor):
        value = value.to_tf()
    elif layout is not None and not (isinstance(value, tf.Tensor) and dtensor.is_dtensor(value)):
        # a whole tensor: distribute it onto the weight's layout (from rank 0's copy if asked)
        current = DTensor.from_tf(module_backend(variable, "set_state_dict").stored_value(variable))
        src = 0 if options.broadcast_from_rank0 else None
        full = value if value is not None else np.zeros(variable.shape, variable.dtype)
        value = distribute_tensor(full, current.device_mesh, current.placements, src_data_rank=src).to_tf()
    shape = tuple(getattr(value, "shape", np.shape(value)))
    if shape != tuple(variable.shape):
        raise ValueError(f"set_state_dict: {name!r} has shape {shape}, the model's weight is {tuple(variable.shape)}.")
    if layout is not None and dtensor.is_dtensor(value) and dtensor.fetch_layout(value) != layout:
        value = dtensor.relayout(value, layout)
    variable.assign(value)


def _check_rank0_shapes(state_dict: dict[str, Any], variables: dict[str, Any], api: str) -> None:
    """With broadcast_from_rank0, every client learns rank 0's shapes first, so a wrong value raises
    the same error everywhere instead of a collective failing half-way."""
    group = Group(no_dist=False)
    shapes = {k: tuple(v.shape) if hasattr(v, "shape") else np.shape(v) for k, v in state_dict.items()} \
        if group.is_coordinator else None
    shapes = group.broadcast(shapes)
    for name, shape in shapes.items():
        if name in variables and shape != tuple(variables[name].shape):
            raise ValueError(f"{api}: {name!r} has shape {shape} on rank 0, the model's weight is "
                             f"{tuple(variables[name].shape)}.")


def _check_keys(given: set[str], expected: set[str], options: StateDictOptions, what: str) -> _IncompatibleKeys:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if options.strict and (missing or unexpected):
        raise KeyError(f"{what}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]} "
                       "(pass StateDictOptions(strict=False) to load the rest).")
    return _IncompatibleKeys(missing, unexpected)


def set_model_state_dict(model: Any, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Writes a model state dict (as ``get_model_state_dict`` gives it) into the model.

    Returns ``(missing_keys, unexpected_keys)``; with ``strict`` either raises.

    Example::

        sd = get_model_state_dict(model)
        tfdist.checkpoint.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd)
    """
    options = _options(options)
    _check_model(model, "set_model_state_dict")
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"set_model_state_dict: model_state_dict must be a dict. "
                        f"Received: {type(model_state_dict).__name__}")
    variables = _model_variables(model, options)
    receiving = options.broadcast_from_rank0 and _runtime.get_rank() != 0
    if options.broadcast_from_rank0:
        _check_rank0_shapes(model_state_dict, variables, "set_model_state_dict")
    if not receiving:
        result = _check_keys(set(model_state_dict), set(variables), options, "set_model_state_dict")
    else:
        result = _IncompatibleKeys([], [])
    for name, variable in variables.items():
        if name in model_state_dict or receiving:
            _assign(variable, model_state_dict.get(name), name, options)
    return result


def set_optimizer_state_dict(model: Any, optimizers: Any, optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Writes an optimizer state dict (as ``get_optimizer_state_dict`` gives it) into the optimizers.

    Example::

        set_optimizer_state_dict(model, model.optimizer, osd)
    """
    options = _options(options)
    _check_model(model, "set_optimizer_state_dict")
    receiving = options.broadcast_from_rank0 and _runtime.get_rank() != 0
    if not receiving and (not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict):
        raise ValueError("set_optimizer_state_dict: optim_state_dict must be {'state': ..., 'param_groups': ...} "
                         f"as get_optimizer_state_dict returns it. Received keys: "
                         f"{sorted(optim_state_dict) if isinstance(optim_state_dict, dict) else optim_state_dict!r}")
    state = {} if receiving else optim_state_dict["state"]
    groups = [] if receiving else optim_state_dict.get("param_groups", [])
    for k, optim in enumerate(_optimizers(optimizers)):
        _ensure_built(model, optim)
        slots = _weights.slots_by_param(model, optim)
        if not receiving:
            _check_keys(set(state), set(slots), options, "set_optimizer_state_dict")
        for name, per_slot in slots.items():
            for slot, variable in per_slot.items():
                value = None if receiving else state.get(name, {}).get(slot)
                if value is not None or receiving:
                    _assign(variable, value, f"{name}/{slot}", options)
        group = groups[k] if k < len(groups) else {}
        for key, variable in _optimizer_scalars(optim).items():
            if key in group:
                value = group[key]
                value = value.full_tensor() if isinstance(value, DTensor) else tf.convert_to_tensor(value)
                variable.assign(tf.cast(value, variable.dtype))


def set_state_dict(model: Any, optimizers: Any, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """``set_model_state_dict`` and ``set_optimizer_state_dict`` together.

    Example::

        model_sd, optim_sd = get_state_dict(model, model.optimizer)
        tfdist.checkpoint.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, model.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    """
    result = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return result
