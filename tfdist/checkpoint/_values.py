"""State-dict leaves: which are tensors, how each is stored, and how a loaded value goes back.

A leaf is a tensor when it is a tfdist ``DTensor``, a TF DTensor, a
``tf.Variable`` / Keras variable, a ``tf.Tensor`` or a numpy array; anything
else is an object (pickled).  Sharded values are stored as the chunks a TF
layout can name: a tfdist DTensor whose placements TF cannot express directly
(Partial, uneven Shard, a dim over several mesh dims) is stored through
``DTensor.to_tf`` after keeping only the outermost mesh dim of each
multi-mesh-dim dim, so the chunks on disk are always plain rectangles.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.checkpoint.metadata import ChunkStorageMetadata
from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._api import DTensor, distribute_tensor
from tfdist.tensor._modules import module_backend
from tfdist.tensor._layout import DTensorSpec, placements_from_tf_layout
from tfdist.tensor.placement_types import Replicate


def is_variable(obj: Any) -> bool:
    """A tf.Variable or a Keras variable (both assign in place)."""
    if isinstance(obj, tf.Variable):
        return True
    return type(obj).__module__.startswith("keras") and hasattr(obj, "assign") and hasattr(obj, "path")


def is_tensor_like(obj: Any) -> bool:
    return isinstance(obj, (StagedValue, DTensor, tf.Tensor, np.ndarray, np.generic)) or is_variable(obj)


def _variable_value(variable: Any) -> tf.Tensor:
    if isinstance(variable, tf.Variable):
        return variable.read_value()
    return module_backend(variable, "checkpoint").stored_value(variable)


def storable(obj: Any) -> tf.Tensor:
    """The TF tensor (a TF DTensor when sharded) whose chunks are written for ``obj``."""
    if isinstance(obj, StagedValue):
        return obj
    if isinstance(obj, DTensor):
        spec = obj._spec
        if spec.multi_dims:
            outer = spec.outer_only()
            obj = obj.redistribute(outer.mesh, outer.placements)
        return obj.to_tf()
    if is_variable(obj):
        return _variable_value(obj)
    if isinstance(obj, tf.Tensor):
        return obj
    return tf.convert_to_tensor(np.asarray(obj))


def is_sharded(t: Any) -> bool:
    if isinstance(t, StagedValue):
        return t.sharded
    return dtensor.is_dtensor(t)


def spec_of(t: Any) -> DTensorSpec:
    if isinstance(t, StagedValue):
        return t.spec
    return _spec_of_layout(dtensor.fetch_layout(t).to_string(), tuple(t.shape))


@functools.lru_cache(maxsize=4096)
def _spec_of_layout(layout_str: str, shape: tuple[int, ...]) -> DTensorSpec:
    layout = dtensor.Layout.from_string(layout_str)
    return DTensorSpec(DeviceMesh.from_tf(layout.mesh), placements_from_tf_layout(layout), shape)


def describe_layout(t: Any) -> dict | None:
    """How a sharded value was laid out when saved (for the metadata; loads do not need it)."""
    if not is_sharded(t):
        return None
    spec = spec_of(t)
    return {"mesh_shape": list(spec.mesh.shape), "mesh_dim_names": list(spec.mesh.mesh_dim_names or ()),
            "placements": [str(p) for p in spec.placements]}


@dataclasses.dataclass
class LocalChunk:
    chunk: ChunkStorageMetadata
    value: tf.Tensor | None  # filled when staged


def local_chunks(t: tf.Tensor, with_values: bool) -> list[LocalChunk]:
    """This client's distinct chunks of ``t`` (one per shard its devices hold, replicas once).

    ``with_values`` also returns each chunk's tensor (the device's component,
    an explicit local view: checkpoint I/O, never a training step).
    """
    if isinstance(t, StagedValue):
        return t.chunks
    if not is_sharded(t):
        shape = tuple(t.shape)
        return [LocalChunk(ChunkStorageMetadata(offsets=(0,) * len(shape), sizes=shape),
                           t if with_values else None)]
    spec = spec_of(t)
    components = dtensor.unpack(t) if with_values else [None] * len(spec.mesh.local_devices())
    seen, out = set(), []
    for component, coord in zip(components, spec.mesh.local_coordinates()):
        sizes, offsets = spec.local_shape_and_offset(coord)
        if offsets in seen:
            continue
        seen.add(offsets)
        out.append(LocalChunk(ChunkStorageMetadata(offsets=offsets, sizes=sizes), component))
    return out


def _read_spec(template: DTensor) -> DTensorSpec:
    """The TF-expressible spec nearest ``template``'s, which a load reads into before moving on."""
    spec = template._spec
    if spec.multi_dims:
        spec = spec.outer_only()
    fixed = [Replicate() if p.is_partial() or (getattr(p, "dim", None) in spec.uneven_dims) else p
             for p in spec.root_placements]
    return DTensorSpec(spec.mesh.root_mesh, tuple(fixed), spec.shape)


def target_layout(template: Any) -> dtensor.Layout | None:
    """The TF layout a loaded value must have to replace ``template`` (None: an ordinary tensor)."""
    t = None
    if isinstance(template, DTensor):
        return _read_spec(template).tf_layout
    if is_variable(template):
        t = _variable_value(template)
    elif isinstance(template, tf.Tensor):
        t = template
    if t is not None and dtensor.is_dtensor(t):
        return dtensor.fetch_layout(t)
    return None


def template_shape_dtype(template: Any) -> tuple[tuple[int, ...], tf.DType]:
    if isinstance(template, DTensor):
        return tuple(template.shape), template.dtype
    if is_variable(template):
        return tuple(template.shape), tf.as_dtype(template.dtype)
    if isinstance(template, tf.Tensor):
        return tuple(template.shape), template.dtype
    arr = np.asarray(template)
    return arr.shape, tf.as_dtype(arr.dtype)


def _onto_template(template: Any, value: Any) -> Any:
    layout = target_layout(template)
    if layout is None:
        return tf.convert_to_tensor(value)
    spec = _spec_of_layout(layout.to_string(), tuple(template.shape))
    return distribute_tensor(tf.convert_to_tensor(value), spec.mesh, spec.placements).to_tf()


def put_back(template: Any, value: tf.Tensor) -> Any:
    """Writes ``value`` into ``template`` when it can change in place (variables); returns what the
    state dict should hold afterwards."""
    if not (isinstance(value, tf.Tensor) and dtensor.is_dtensor(value)):
        value = _onto_template(template, value)  # a whole value from a custom storage reader
    if isinstance(template, DTensor):
        spec = _read_spec(template)
        loaded = DTensor._wrap(value, spec)
        if spec.placements != template._spec.root_placements:
            loaded = loaded.redistribute(template.device_mesh, template.placements)
        elif template.device_mesh is not spec.mesh:
            loaded = DTensor._wrap(value, template._spec)
        return loaded
    if is_variable(template):
        template.assign(value)
        return template
    if isinstance(template, np.ndarray) and template.flags.writeable:
        template[...] = value.numpy()  # in place, as torch loads into a tensor
        return template
    if isinstance(template, (np.ndarray, np.generic)):
        return value.numpy()
    return value


@dataclasses.dataclass
class StagedValue:
    """A snapshot of one tensor for ``async_save``: this client's chunks, on the host."""

    shape: tuple[int, ...]
    dtype: tf.DType
    sharded: bool
    chunks: list[LocalChunk]
    spec: DTensorSpec | None = None


def _inner_variable(obj: Any) -> tf.Variable | None:
    if isinstance(obj, tf.Variable):
        return obj
    inner = getattr(obj, "_value", None) if is_variable(obj) else None
    return inner if isinstance(inner, tf.Variable) else None


_READERS: collections.OrderedDict = collections.OrderedDict()


def read_variables(objs: list[Any]) -> dict[int, tf.Tensor]:
    """The values of the variables among ``objs`` (by ``id``), read by one program per mesh: staging
    then costs one dispatch, not one per variable."""
    groups: dict[str, list[tuple[Any, tf.Variable]]] = {}
    for obj in objs:
        var = _inner_variable(obj)
        if var is None:
            continue
        layout = getattr(var, "layout", None) if isinstance(var, dtensor.DVariable) else None
        groups.setdefault(layout.mesh.to_string() if layout is not None else "", []).append((obj, var))
    out: dict[int, tf.Tensor] = {}
    for pairs in groups.values():
        variables = [v for _, v in pairs]
        key = tuple(v._unique_id for v in variables)
        reader = _READERS.get(key)
        if reader is None:
            reader = tf.function(lambda vs=tuple(variables): [v.read_value() for v in vs], autograph=False)
            _READERS[key] = reader
            if len(_READERS) > 8:  # the traced readers hold their variables; keep only recent ones
                _READERS.popitem(last=False)
        _READERS.move_to_end(key)
        for (obj, _), value in zip(pairs, reader()):
            out[id(obj)] = value
    return out


def stage(obj: Any, value: tf.Tensor | None = None) -> Any:
    """Snapshots a state-dict leaf so training may change the original while it is written.

    Tensors are immutable, and TF copies a variable's buffer before updating it
    in place while another tensor still refers to it, so on the host the value
    read now (``value``, if already read) is the snapshot; a sharded value on
    GPU/TPU is split into this client's chunks, copied to host memory.
    """
    if isinstance(obj, StagedValue):
        return obj
    if not is_tensor_like(obj):
        return copy.deepcopy(obj)
    t = value if value is not None else storable(obj)
    if is_sharded(t) and spec_of(t).mesh.device_type == "cpu":
        return t
    if not is_sharded(t) and "CPU" in (t.device or "CPU").upper():
        return t
    chunks = local_chunks(t, with_values=True)
    for c in chunks:
        with tf.device("CPU:0"):
            c.value = tf.identity(c.value)
    return StagedValue(tuple(t.shape), t.dtype, is_sharded(t), chunks, spec_of(t) if is_sharded(t) else None)
