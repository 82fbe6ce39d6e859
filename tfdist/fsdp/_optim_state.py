"""FSDP1's optimizer-state family (``FullyShardedDataParallel.full_optim_state_dict`` and kin).

torch's FSDP1 flattens parameters, so its optimizer state exists in three
forms: *full* (whole tensors keyed by parameter name, for saving), *sharded*
(ShardedTensors keyed by name) and *flattened* (what the wrapped optimizer
loads).  tfdist never flattens: a Keras optimizer's slot has its parameter's
global shape and is laid out like it (sharded where the parameter is), so
the loadable form is the sharded one -- tfdist DTensors laid out as the
slots -- and ``FullyShardedDataParallel.optim_state_dict_to_load`` (or
``tfdist.checkpoint.state_dict.set_optimizer_state_dict``) writes it.  Every
dict here has torch's shape::

    {"state": {"dense.kernel": {"momentum": ..., "velocity": ...}, ...},
     "param_groups": [{"params": ["dense.kernel", ...], "iterations": ..., "learning_rate": ...}]}

keyed by parameter name, or, after ``rekey_optim_state_dict(...,
OptimStateKeyType.PARAM_ID, model)``, by the parameter's index in
``model.trainable_variables`` (torch's ``model.parameters()`` order).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
from tensorflow.experimental import dtensor

from tfdist import _client_kv, _runtime
from tfdist.fsdp import _state_dict
from tfdist.tensor._api import DTensor, distribute_tensor
from tfdist.tensor._modules import module_backend

__all__ = [
    "OptimStateKeyType", "optim_state", "full_optim_state_dict", "sharded_optim_state_dict", "shard_full_optim_state_dict",
    "scatter_full_optim_state_dict", "flatten_sharded_optim_state_dict", "rekey_optim_state_dict",
]


class OptimStateKeyType(enum.Enum):
    """How ``"state"`` is keyed: by parameter name, or by its index in ``model.trainable_variables``."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


def _check_group(group: Any, api: str) -> None:
    if group is not None:
        raise ValueError(f"FullyShardedDataParallel.{api}: group must be None (every client takes part). "
                         f"Received: group={group!r}")


def optim_state(model: Any, optim: Any, settings: _state_dict.StateDictSettings) -> dict[str, Any]:
    """The optimizer's slots by parameter name in the form ``settings`` give (FSDP1's
    ``optim_state_dict`` and the family below); ``{}`` off client 0 for a rank-0-only full dict."""
    config = settings.optim_state_dict_config
    rank0_only = getattr(config, "rank0_only", False)
    full = settings.state_dict_type == _state_dict.StateDictType.FULL_STATE_DICT
    slots = _state_dict.slots_by_param(model, optim)
    state = {name: {slot: _state_dict.export_value(v, settings, optim=True) for slot, v in per_slot.items()}
             for name, per_slot in slots.items()}  # every client reads: gathers are collective
    if full and rank0_only and not _state_dict.is_writer():
        return {}
    groups = {k: v for k, v in optim.get_config().items() if isinstance(v, (int, float, str, bool))}
    groups["params"] = sorted(state)
    return {"state": state, "param_groups": [groups]}


def full_optim_state_dict(model: Any, optim: Any, optim_input: Any = None, rank0_only: bool = True,
                          group: Any = None) -> dict[str, Any]:
    """The whole optimizer state (numpy arrays) keyed by parameter name; with ``rank0_only``
    (torch's default) clients other than 0 get ``{}``.  Collective: every client calls it."""
    _check_group(group, "full_optim_state_dict")
    settings = _state_dict.StateDictSettings(
        _state_dict.StateDictType.FULL_STATE_DICT, _state_dict.FullStateDictConfig(),
        _state_dict.FullOptimStateDictConfig(rank0_only=bool(rank0_only)))
    return optim_state(model, optim, settings)


def sharded_optim_state_dict(model: Any, optim: Any, group: Any = None) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, each sharded slot a tfdist DTensor with its
    placements (no communication) -- torch's ShardedTensor form, loadable as it is."""
    _check_group(group, "sharded_optim_state_dict")
    settings = _state_dict.StateDictSettings(
        _state_dict.StateDictType.SHARDED_STATE_DICT, _state_dict.ShardedStateDictConfig(),
        _state_dict.ShardedOptimStateDictConfig(offload_to_cpu=False))
    return optim_state(model, optim, settings)


def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: Any, optim_input: Any = None,
                                optim: Any = None) -> dict[str, Any]:
    """A full optimizer state dict (e.g. ``full_optim_state_dict``'s, saved with another number of
    devices) laid out for ``model``: each value of a parameter's shape becomes a tfdist DTensor with
    the layout of that parameter's slot (``optim``'s own slot when it is built, else the
    parameter's); scalars stay.  Every client holds the whole dict; no communication."""
    state = _checked_state(full_optim_state_dict, "shard_full_optim_state_dict")
    targets = _slot_targets(model, optim)
    out = {}
    for name, per_slot in state.items():
        if name not in targets["params"]:
            raise KeyError(f"shard_full_optim_state_dict: {name!r} is not a parameter of the model "
                           f"(parameters: {sorted(targets['params'])[:5]}...).")
        out[name] = {slot: _laid_out(value, name, slot, targets) for slot, value in per_slot.items()}
    return {"state": out, "param_groups": list(full_optim_state_dict.get("param_groups", []))}


def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: Any,
                                  optim_input: Any = None, optim: Any = None, group: Any = None) -> dict[str, Any]:
    """``shard_full_optim_state_dict`` of client 0's dict (the others pass None or ``{}``).

    Client 0's dict reaches the other clients through TF's coordination service (the whole dict:
    a TF DTensor is made by every client from the same global value), then each lays it out.
    """
    _check_group(group, "scatter_full_optim_state_dict")
    kv = _client_kv.Group(no_dist=False, namespace="fsdp")
    mine = full_optim_state_dict if _runtime.get_rank() == 0 else None
    if kv.is_coordinator:
        _checked_state(mine, "scatter_full_optim_state_dict")
        mine = _map_values(mine, lambda v: v.numpy() if hasattr(v, "numpy") else v)
    return shard_full_optim_state_dict(kv.broadcast(mine), model, optim=optim)


def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: Any,
                                     optim: Any) -> dict[str, Any]:
    """A sharded optimizer state dict (``sharded_optim_state_dict``'s, perhaps from another mesh or
    layout) laid out as ``optim``'s slots for ``model``: DTensors redistributed (on the same root
    mesh) or gathered and laid out again (another mesh), whole values distributed."""
    state = _checked_state(sharded_optim_state_dict, "flatten_sharded_optim_state_dict")
    targets = _slot_targets(model, optim)
    out = {name: {slot: _laid_out(value, name, slot, targets) for slot, value in per_slot.items()}
           for name, per_slot in state.items()}
    return {"state": out, "param_groups": list(sharded_optim_state_dict.get("param_groups", []))}


def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                           model: Any, optim_input: Any = None, optim: Any = None) -> dict[str, Any]:
    """The same dict keyed by ``optim_state_key_type``: ``PARAM_ID`` (index in
    ``model.trainable_variables``, torch's ``model.parameters()`` order) or ``PARAM_NAME``; the
    param groups' ``"params"`` lists follow.  Values are not copied."""
    if not isinstance(optim_state_key_type, OptimStateKeyType):
        raise ValueError("rekey_optim_state_dict: optim_state_key_type must be OptimStateKeyType.PARAM_NAME or "
                         f".PARAM_ID. Received: {optim_state_key_type!r}")
    state = _checked_state(optim_state_dict, "rekey_optim_state_dict", any_keys=True)
    names = _param_names(model)
    ids = {name: i for i, name in enumerate(names)}

    def key(k: Any) -> Any:
        if optim_state_key_type == OptimStateKeyType.PARAM_ID:
            if isinstance(k, int):
                return k
            if k not in ids:
                raise KeyError(f"rekey_optim_state_dict: {k!r} is not a trainable parameter of the model.")
            return ids[k]
        if isinstance(k, str):
            return k
        if not 0 <= k < len(names):
            raise KeyError(f"rekey_optim_state_dict: parameter id {k} is out of range (the model has "
                           f"{len(names)} trainable parameters).")
        return names[k]

    groups = []
    for group in optim_state_dict.get("param_groups", []):
        group = dict(group)
        if "params" in group:
            group["params"] = [key(k) for k in group["params"]]
        groups.append(group)
    return {"state": {key(k): v for k, v in state.items()}, "param_groups": groups}


# -- helpers ------------------------------------------------------------------------------------

def _checked_state(osd: Any, api: str, any_keys: bool = False) -> dict[Any, dict[str, Any]]:
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict):
        got = sorted(osd) if isinstance(osd, dict) else type(osd).__name__
        raise ValueError(f"FullyShardedDataParallel.{api}: expected an optimizer state dict "
                         f"{{'state': ..., 'param_groups': ...}}. Received: {got!r}")
    if not any_keys and any(not isinstance(k, str) for k in osd["state"]):
        raise ValueError(f"FullyShardedDataParallel.{api}: the state is keyed by parameter id; rekey it first: "
                         "rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model).")
    return osd["state"]


def _param_names(model: Any) -> list[str]:
    """Trainable parameters' names in ``model.trainable_variables`` order."""
    name_of = {id(v): name for name, v in _state_dict.named_weights(model).items()}
    return [name_of[id(v)] for v in model.trainable_variables if id(v) in name_of]


def _slot_targets(model: Any, optim: Any) -> dict[str, Any]:
    """The variables whose layouts the values take: ``optim``'s slots when built, and the params."""
    params = _state_dict.named_weights(model)
    slots = _state_dict.slots_by_param(model, optim) if optim is not None and getattr(optim, "built", False) else {}
    return {"params": params, "slots": slots}


def _laid_out(value: Any, name: str, slot: str, targets: dict[str, Any]) -> Any:
    """``value`` as a DTensor laid out like its slot (or its parameter) when it has that shape."""
    variable = targets["slots"].get(name, {}).get(slot, targets["params"][name])
    shape = tuple(variable.shape)
    if tuple(np.shape(value) if not isinstance(value, DTensor) else value.shape) != shape:
        if slot in targets["slots"].get(name, {}):
            raise ValueError(f"optimizer state {name!r}/{slot!r} has shape {tuple(np.shape(value))}; the "
                             f"optimizer's slot has shape {shape}.")
        return value  # a per-parameter scalar (a step count): kept as it is
    stored = module_backend(variable, "shard_full_optim_state_dict").stored_value(variable)
    if not dtensor.is_dtensor(stored):  # a variable not on a mesh: the whole value
        return value.full_tensor().numpy() if isinstance(value, DTensor) else value
    target = DTensor.from_tf(stored)
    if isinstance(value, DTensor):
        if value.device_mesh.root_mesh == target.device_mesh.root_mesh:
            return value.redistribute(target.device_mesh, target.placements)
        value = value.full_tensor().numpy()
    return distribute_tensor(np.asarray(value), target.device_mesh, target.placements)


def _map_values(osd: dict[str, Any], fn) -> dict[str, Any]:
    state = {k: {slot: fn(v) for slot, v in per.items()} for k, per in osd["state"].items()}
    groups = [{k: (fn(v) if hasattr(v, "numpy") else v) for k, v in g.items()} for g in osd.get("param_groups", [])]
    return {"state": state, "param_groups": groups}
