"""The TF backend's half of ``keras.distribution``, which Keras 3 leaves empty.

Keras' ``DeviceMesh``/``TensorLayout``/``LayoutMap``/``DataParallel``/
``ModelParallel`` are backend-neutral; they reach the backend through
``keras.src.backend.tensorflow.distribution_lib``.  tfdist fills that seam
with TF DTensor: a Keras ``DeviceMesh`` becomes a tfdist ``DeviceMesh`` (one
``dtensor.Mesh``), a ``TensorLayout`` a ``dtensor.Layout``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.framework import ops

from tfdist import _patches, _runtime
from tfdist.device_mesh import DeviceMesh
from tfdist.keras._keras_internals import distribution_lib
from tfdist.tensor._cross_mesh import replicated_on

__all__ = ["tfdist_mesh", "to_tf_layout", "distribute_tensor", "install"]


@functools.lru_cache(maxsize=None)
def _mesh_for(shape: tuple[int, ...], names: tuple[str, ...], device_type: str, ids: tuple[int, ...]) -> DeviceMesh:
    return DeviceMesh(device_type, np.asarray(ids).reshape(shape), mesh_dim_names=names)


def tfdist_mesh(keras_mesh: Any) -> DeviceMesh:
    """The tfdist DeviceMesh of a ``keras.distribution.DeviceMesh`` (cached: one mesh per layout)."""
    devices = [str(d) for d in np.asarray(keras_mesh.devices).ravel()]
    kinds = {d.split(":")[0].lower() for d in devices}
    if len(kinds) != 1:
        raise ValueError(f"a DeviceMesh must hold one device type. Received: devices={devices}")
    ids = tuple(int(d.split(":")[-1]) for d in devices)
    return _mesh_for(tuple(keras_mesh.shape), tuple(keras_mesh.axis_names), kinds.pop(), ids)


def _to_backend_mesh(keras_mesh: Any) -> dtensor.Mesh:
    return tfdist_mesh(keras_mesh).to_tf()


def to_tf_layout(tensor_layout: Any) -> dtensor.Layout:
    """``keras.distribution.TensorLayout`` -> ``dtensor.Layout`` (None axes are unsharded)."""
    if tensor_layout.device_mesh is None:
        raise ValueError(
            "a TensorLayout needs a device_mesh before it can be used; pass "
            "device_mesh= or put it in a LayoutMap."
        )
    mesh = tfdist_mesh(tensor_layout.device_mesh)
    specs = [dtensor.UNSHARDED if a is None else a for a in tensor_layout.axes]
    for a in specs:
        if a != dtensor.UNSHARDED and a not in mesh.axis_names:
            raise ValueError(
                f"TensorLayout axis {a!r} is not a mesh dim of {mesh.axis_names}. "
                f"Received: axes={tensor_layout.axes!r}"
            )
    return dtensor.Layout(specs, mesh.to_tf())


def _as_tf_layout(layout: Any) -> dtensor.Layout:
    if isinstance(layout, dtensor.Layout):
        return layout
    return to_tf_layout(layout)


def distribute_tensor(tensor: Any, layout: Any) -> Any:
    """Relayouts a value (eager or in a traced step) onto ``layout``.

    A nested value (a layer returning a tuple or dict, given an ``/output``
    layout) has each tensor of the rank of the layout relayouted; other
    leaves pass through, as under JAX's sharding constraint on a pytree.
    """
    if tf.nest.is_nested(tensor):
        return tf.nest.map_structure(lambda t: _distribute_leaf(t, layout), tensor)
    return _distribute_one(tensor, layout)


def _distribute_leaf(tensor: Any, layout: Any) -> Any:
    rank = len(getattr(layout, "axes", ())) if not hasattr(layout, "for_tensor") else None
    if not isinstance(tensor, (tf.Tensor, tf.Variable)) or (rank is not None and tensor.shape.rank != rank):
        return tensor
    return _distribute_one(tensor, layout)


def _distribute_one(tensor: Any, layout: Any) -> tf.Tensor:
    if hasattr(layout, "for_tensor"):  # a tfdist LayoutMap value, resolved by rank
        layout = layout.for_tensor(tensor)
        if layout is None:
            return tensor
    tf_layout = _as_tf_layout(layout)
    tensor = tf.convert_to_tensor(tensor)
    if tf.executing_eagerly() and (not dtensor.is_dtensor(tensor)
                                   or dtensor.fetch_layout(tensor).mesh != tf_layout.mesh):
        # a host value, or an initial value made on another model's mesh (a DTensor default mesh
        # still current): relayout cannot cross meshes, a replicated copy can
        tensor = replicated_on(tensor, tf_layout.mesh)
    return dtensor.relayout(tensor, tf_layout)


_mesh_variables_made = False


def traced_like_keras(function: Any, **options: Any) -> Any:
    """``tf.function(function)`` as Keras' TF backend traces a step: without autograph.

    Keras wraps its step in ``tf.autograph.experimental.do_not_convert``
    (``TensorFlowTrainer._make_function``), so a model's Python runs as Python when traced.
    With autograph on, a tfdist step would convert every function it reaches outside TF's and
    Keras' own modules (keras-hub's ``train_step`` and ``__call__``, a user's model): slower
    to trace (keras-hub's Gemma step: 3.5 against 2.3 s) and a different language, where a
    Python ``if`` on a tensor works on a mesh and fails on one device.  (A layer called
    eagerly is another matter: Keras runs it as eager Python, where such an ``if`` works, so
    tfdist's traced eager calls keep autograph; ``_eager_calls``.)

    Example::

        step = traced_like_keras(model.train_step, reduce_retracing=True)
    """
    return tf.function(function, autograph=False, **options)


def mesh_variables_exist() -> bool:
    """tfdist has placed a Keras variable on a mesh in this process.  Until then no layer can hold
    one, and the rows on Keras' call path hand every call to Keras (``_host_tensors``)."""
    return _mesh_variables_made


# The name every eager VarHandleOp tfdist runs on a mesh carries (its trailing "/" makes the scope
# absolute, so Keras' layer scopes do not enter it either). TF DTensor keys its cache of lowered
# eager ops by every attribute of the op (``ExecutableManager<T>::CacheKeyForGraph``,
# tensorflow/dtensor/cc/dtensor_device_util.h: ``SerializeToStringDeterministic(attributes, ...)``),
# and VarHandleOp's ``debug_name`` is the variable's name: each variable of a new name had its
# handle op SPMD-expanded again, 15-37 ms against 2-3 ms for a cached one on 8 virtual CPUs -- 74
# Adam slots of W2's GPT took 2.2 s of its first step (docs/performance.md).
_HANDLE_SCOPE = "tfdist_variable/"


def new_dvariable(value: Any, layout: Any, name: str | None = None, **kwargs: Any) -> dtensor.DVariable:
    """``value`` laid out by ``layout`` as the DVariable a Keras variable keeps (every such variable
    is made here), named ``name`` as ``tf.Variable`` names it, its handle op one TF DTensor has
    lowered before for the same shape, dtype and layout."""
    global _mesh_variables_made
    _mesh_variables_made = True
    value = distribute_tensor(value, layout)
    with tf.init_scope():  # where tf.Variable makes (and names) a variable, also inside a trace
        eager = tf.executing_eagerly()
        with ops.name_scope(name, "Variable", skip_on_eager=False) as scope:
            handle_name = ops.name_from_scope_name(scope)  # what tf.Variable would call it there
    if not eager:  # a graph variable's shared_name is its name: it must stay its own
        return dtensor.DVariable(value, name=name, **kwargs)
    variable = dtensor.DVariable(value, name=_HANDLE_SCOPE, **kwargs)
    variable._handle_name = handle_name + ":0"
    variable._unique_id = f"{handle_name}_{ops.uid()}"
    return variable


def _distribute_variable(value: Any, layout: Any) -> dtensor.DVariable:
    return new_dvariable(value, layout)


def _num_processes() -> int:
    return _runtime.get_world_size()


def _process_id() -> int:
    return _runtime.get_rank()


def _get_device_count(device_type: str | None = None) -> int:
    kind = (device_type or _runtime.detect_device_type()).upper()
    return _runtime.num_global_devices(kind)


def _list_devices(device_type: str | None = None) -> list[str]:
    """Every client's devices, numbered globally (``"cpu:0" .. "cpu:N-1"``), as tfdist's meshes and
    JAX number them; TF's logical devices of other clients repeat the same local numbers."""
    kind = _runtime.normalize_device_type(device_type) if device_type else _runtime.detect_device_type()
    return [f"{kind.lower()}:{i}" for i in range(_runtime.num_global_devices(kind))]


def initialize(job_addresses: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """``keras.distribution.initialize`` on TensorFlow: joins tfdist's multi-client runtime.

    Keras passes its arguments or its environment variables
    (``KERAS_DISTRIBUTION_JOB_ADDRESSES``, ``..._NUM_PROCESSES``,
    ``..._PROCESS_ID``). TF DTensor needs every client's address, so
    ``job_addresses`` lists one ``host:port`` per process, process 0 first
    (JAX's coordinator-only form names too few). Given nothing, the
    environment ``tfdist run`` sets is used.

    Example::

        keras.distribution.initialize("10.0.0.1:1234,10.0.0.2:2345", num_processes=2, process_id=0)
    """
    env: dict[str, str] = {}
    if num_processes is not None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, (int, np.integer)) or num_processes < 1:
            raise ValueError(f"num_processes must be a positive int. Received: num_processes={num_processes!r}")
        env["DTENSOR_NUM_CLIENTS"] = str(int(num_processes))
    world = int(env.get("DTENSOR_NUM_CLIENTS", os.environ.get("DTENSOR_NUM_CLIENTS", "1")))
    if process_id is not None:
        if isinstance(process_id, bool) or not isinstance(process_id, (int, np.integer)) \
                or not 0 <= process_id < world:
            raise ValueError(f"process_id must be an int in [0, {world}) for {world} processes. "
                             f"Received: process_id={process_id!r}")
        env["DTENSOR_CLIENT_ID"] = str(int(process_id))
    if job_addresses is not None:
        jobs = [j.strip() for j in str(job_addresses).split(",") if j.strip()]
        if len(jobs) != world or any(":" not in j for j in jobs):
            raise ValueError(
                f"job_addresses must list one host:port per process ({world}), process 0 first: TF DTensor "
                f"connects every client to every other. Received: job_addresses={job_addresses!r}")
        env["DTENSOR_JOBS"] = ",".join(jobs)
    if env:
        os.environ.update(env)
        os.environ.setdefault("DTENSOR_JOB_NAME", "worker")
    _runtime.init_distributed()


def install() -> None:
    """Fills Keras' TF ``distribution_lib`` with the functions above (rows of tfdist._patches)."""
    lib = "keras.src.backend.tensorflow.distribution_lib:"
    _patches.install(lib + "_to_backend_mesh", _to_backend_mesh)
    _patches.install(lib + "_to_backend_layout", to_tf_layout)
    _patches.install(lib + "distribute_tensor", distribute_tensor)
    _patches.install(lib + "distribute_value", distribute_tensor)
    _patches.install(lib + "distribute_variable", _distribute_variable)
    _patches.install(lib + "num_processes", _num_processes)
    _patches.install(lib + "process_id", _process_id)
    _patches.install(lib + "get_device_count", _get_device_count)
    _patches.install(lib + "initialize", initialize)
    _patches.install(lib + "list_devices", _list_devices)
    for module in ("keras.src.distribution.distribution_lib", "keras.src.distribution", "keras.distribution"):
        _patches.install(module + ":set_distribution", _checked_set_distribution)


def _checked_set_distribution(value: Any) -> None:
    """Keras' ``set_distribution`` refusing, at the call, what is not a distribution (Keras stores any
    value, and a layer fails on it later: "'str' object has no attribute 'get_variable_layout'")."""
    if value is not None and not isinstance(value, distribution_lib.Distribution):
        raise TypeError("keras.distribution.set_distribution expects a keras.distribution.Distribution (e.g. "
                        f"DataParallel, ModelParallel) or None. Received: value={value!r} of type "
                        f"{type(value).__name__}")
    _patches.original("keras.src.distribution.distribution_lib:set_distribution")(value)
