"""FSDP1's state-dict types (torch.distributed.fsdp.StateDictType and its configs).

Keras models have weights by path, not a ``state_dict``; an FSDP1 module
(``FullyShardedDataParallel``) gets torch's ``state_dict()`` /
``load_state_dict()``, keyed by torch-style names (``blocks.0.mlp.up.kernel``:
the layer's path and the weight's name), in the form the module's
``state_dict_type`` says:

* ``FULL_STATE_DICT``: whole arrays (numpy), every weight gathered;
  ``rank0_only`` leaves other clients' dicts empty.
* ``SHARDED_STATE_DICT``: tfdist ``DTensor`` s with their placements (no
  communication).
* ``LOCAL_STATE_DICT``: this client's shards, one tensor per local device.

``FullyShardedDataParallel.optim_state_dict`` gives the optimizer's slots
the same way, under ``{"state": {name: {slot: value}}, "param_groups": [...]}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any, Iterator

import numpy as np
from tensorflow.experimental import dtensor

from tfdist import _registry, _runtime
from tfdist.tensor._api import DTensor
from tfdist.tensor._modules import module_backend

__all__ = [
    "StateDictType", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
    "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig", "StateDictSettings",
]


class StateDictType(enum.Enum):
    """The form of ``state_dict()`` (torch's names)."""

    FULL_STATE_DICT = 1
    LOCAL_STATE_DICT = 2
    SHARDED_STATE_DICT = 3


@dataclasses.dataclass
class StateDictConfig:
    """``offload_to_cpu``: values are host arrays (FULL is always numpy)."""

    offload_to_cpu: bool = False


@dataclasses.dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only client 0 gets the values; the others get ``{}``."""

    rank0_only: bool = False


@dataclasses.dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Sharded values as tfdist DTensors.  ``_use_dtensor`` is torch's switch between its
    ``ShardedTensor`` and ``DTensor``; tfdist's sharded values are always DTensors (TF has no
    ``ShardedTensor``), so either value gives them."""

    _use_dtensor: bool = False


@dataclasses.dataclass
class LocalStateDictConfig(StateDictConfig):
    """Local shards, one per local device."""


@dataclasses.dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclasses.dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclasses.dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Sharded optimizer state as tfdist DTensors (``_use_dtensor``: as ``ShardedStateDictConfig``)."""

    _use_dtensor: bool = False


@dataclasses.dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclasses.dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


_DEFAULTS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def default_settings() -> StateDictSettings:
    return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def make_settings(state_dict_type: Any, state_dict_config: Any, optim_state_dict_config: Any) -> StateDictSettings:
    if not isinstance(state_dict_type, StateDictType):
        raise ValueError(f"state_dict_type must be a StateDictType. Received: {state_dict_type!r}")
    config_cls, optim_cls = _DEFAULTS[state_dict_type]
    config = state_dict_config if state_dict_config is not None else config_cls()
    optim = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
    if not isinstance(config, config_cls):
        raise ValueError(
            f"{state_dict_type.name} takes a {config_cls.__name__}. Received: state_dict_config={config!r}"
        )
    if not isinstance(optim, optim_cls):
        raise ValueError(
            f"{state_dict_type.name} takes a {optim_cls.__name__}. Received: optim_state_dict_config={optim!r}"
        )
    return StateDictSettings(state_dict_type, config, optim)


def named_weights(module: Any) -> dict[str, Any]:
    """torch-style name -> variable, every weight of the module (trainable or not)."""
    modules = module_backend(module, "state_dict")
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for path, layer in modules.named_layers(module):
        if not modules.is_built(layer):
            continue
        for name, variable in modules.weights(layer).items():
            if id(variable) not in seen:
                seen.add(id(variable))
                out[f"{path}.{name}" if path else name] = variable
    # a weight the walk did not reach (a layer held where the backend does not look) is still
    # saved and loaded, by its own path: a state dict never silently leaves a weight out
    for variable in modules.all_weights(module):
        if id(variable) not in seen and getattr(variable, "path", None):
            seen.add(id(variable))
            out[variable.path.replace("/", ".")] = variable
    return out


def slots_by_param(model: Any, optim: Any) -> dict[str, dict[str, Any]]:
    """Parameter name -> {slot name: slot variable} (Keras names a slot ``<param path with _>_<slot>``)."""
    if not getattr(optim, "built", False):
        raise ValueError("optim_state_dict: the optimizer is not built yet; run a step or optim.build(variables).")
    out = {}
    slots = [v for v in optim.variables if len(v.shape)]
    for name, variable in named_weights(model).items():
        prefix = variable.path.replace("/", "_") + "_"
        mine = {v.name[len(prefix):]: v for v in slots if v.name.startswith(prefix)}
        if mine:
            out[name] = mine
    return out


def export_value(variable: Any, settings: StateDictSettings, optim: bool = False) -> Any:
    """A variable's value in the settings' form."""
    kind = settings.state_dict_type
    config = settings.optim_state_dict_config if optim else settings.state_dict_config
    if kind == StateDictType.FULL_STATE_DICT:
        return np.asarray(variable.numpy())
    value = module_backend(variable, "state_dict").stored_value(variable)
    if not dtensor.is_dtensor(value):
        return np.asarray(value) if config.offload_to_cpu else value
    dt = DTensor.from_tf(value)
    if kind == StateDictType.SHARDED_STATE_DICT:
        return dt
    shards = dt.local_tensors()
    return [np.asarray(s) for s in shards] if config.offload_to_cpu else shards


def import_value(variable: Any, value: Any, settings: StateDictSettings, name: str) -> None:
    """Writes ``value`` (in the settings' form) into the variable."""
    kind = settings.state_dict_type
    if kind == StateDictType.LOCAL_STATE_DICT:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"load_state_dict: {name!r} must be the list of local shards LOCAL_STATE_DICT gave.")
        current = DTensor.from_tf(module_backend(variable, "load_state_dict").stored_value(variable))
        value = DTensor.from_local(list(value), current.device_mesh, current.placements,
                                   shape=current.shape).to_tf()
    elif isinstance(value, DTensor):
        value = value.to_tf()
    if tuple(getattr(value, "shape", np.shape(value))) != tuple(variable.shape):
        raise ValueError(
            f"load_state_dict: {name!r} has shape {tuple(np.shape(value))}, the model's is {tuple(variable.shape)}."
        )
    variable.assign(value)


def is_writer() -> bool:
    return _runtime.get_rank() == 0


@contextlib.contextmanager
def settings_scope(units: list[Any], settings: StateDictSettings) -> Iterator[None]:
    states = [_registry.module(u) for u in units]
    saved = [s.state_dict_settings for s in states]
    for s in states:
        s.state_dict_settings = settings
    try:
        yield
    finally:
        for s, old in zip(states, saved):
            s.state_dict_settings = old
