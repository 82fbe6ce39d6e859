"""Keras optimizers on DTensor: dense updates, slot layouts, reads after writes.

* Writes go through ``_variables.write`` so that a later read in the same
  step sees the written value (the TF DTensor stale-read bug).
* An ``IndexedSlices`` gradient (an Embedding's) is made dense: DTensor has
  no layout for ``ResourceScatterAdd``, and the dense form is textbook Adam
  (Keras 3's sparse Adam squares each repeated row separately, see
  docs/tf_dtensor_repros/keras3_adam_duplicate_indexed_slices.py).
* Slot variables (Adam moments, ...) take the layout of their parameter, or
  the one the optimizer's ``slot_layout(layout, shape)`` (its record in ``tfdist._registry``) gives
  (``tfdist.optim.ZeroRedundancyOptimizer`` shards them over data parallel).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _patches, _registry
from tfdist.keras import _variables
from tfdist.keras._keras_internals import base_optimizer
from tfdist.optim.zero_redundancy_optimizer import sharded_slot_layout

__all__ = ["install"]


def _is_padded(variable) -> bool:
    inner = getattr(variable, "_value", None)
    return isinstance(inner, dtensor.DVariable) and _variables.logical_shape(inner) is not None


def _dense(value):
    if isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    return value


def install() -> None:
    opt = "keras.src.backend.tensorflow.optimizer:TFOptimizer."
    if _patches.installed(opt + "assign"):
        return
    originals = {n: _patches.original(opt + n) for n in ("assign", "assign_add", "assign_sub")}

    def _target(variable):
        return variable._value if isinstance(variable, keras.Variable) else variable

    def make(name, combine):
        original = originals[name]

        def method(self, variable, value):
            dvar = _target(variable)
            if not isinstance(dvar, dtensor.DVariable):
                return original(self, variable, value)
            value = tf.cast(_dense(value), dvar.dtype)
            new = combine(_variables.current_value(dvar), value)
            _variables.write(dvar, new)

        method.__name__ = name
        return method

    _patches.install(opt + "assign", make("assign", lambda old, v: v))
    _patches.install(opt + "assign_add", make("assign_add", lambda old, v: old + v))
    _patches.install(opt + "assign_sub", make("assign_sub", lambda old, v: old - v))

    original_from_reference = _patches.original(opt + "add_variable_from_reference")

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        inner = _target(reference_variable)
        layout = None
        if isinstance(inner, dtensor.DVariable):
            layout = _variables.layout_of(inner)
            # ZeroRedundancyOptimizer's, else data parallel's on devices that share a host's CPU
            own = _registry.optimizer_if_any(self)
            slot_layout = (own.slot_layout if own else None) or _shared_host_slot_layout(layout)
            if slot_layout is not None:
                layout = slot_layout(layout, tuple(reference_variable.shape))
        with _variables.layout_scope(layout):
            return original_from_reference(self, reference_variable, name=name, initializer=initializer)

    _patches.install(opt + "add_variable_from_reference", add_variable_from_reference)

    original_update = _patches.original(opt + "_backend_update_step")

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if not any(_variables.is_dtensor_variable(v) for v in trainable_variables):
            return original_update(self, grads, trainable_variables, learning_rate)
        grads = [_dense(g) for g in grads]
        padded = [_is_padded(v) for v in trainable_variables]
        if any(padded):  # Keras' backend-neutral loop: it updates Keras variables, read at their shape
            base_optimizer.BaseOptimizer._backend_update_step(
                self, [g for g, p in zip(grads, padded) if p],
                [v for v, p in zip(trainable_variables, padded) if p], learning_rate)
            grads = [g for g, p in zip(grads, padded) if not p]
            trainable_variables = [v for v, p in zip(trainable_variables, padded) if not p]
        with _variables.variables_as_handles(trainable_variables):
            return original_update(self, grads, trainable_variables, learning_rate)

    _patches.install(opt + "_backend_update_step", _backend_update_step)

    original_decay = _patches.original(opt + "_apply_weight_decay")

    def _apply_weight_decay(self, variables):
        variables = list(variables)
        padded = [v for v in variables if _is_padded(v)]
        if padded:  # TF's version decays `variable.value`, a tensor cut from the padded storage
            base_optimizer.BaseOptimizer._apply_weight_decay(self, padded)
        return original_decay(self, [v for v in variables if not _is_padded(v)])

    _patches.install(opt + "_apply_weight_decay", _apply_weight_decay)

    original_key = _patches.original(opt + "_var_key")

    def _var_key(self, variable):
        if isinstance(variable, keras.Variable) and isinstance(variable._value, dtensor.DVariable):
            return variable._value._unique_id  # what TF's key is, also where `value` is a read
        return original_key(self, variable)

    _patches.install(opt + "_var_key", _var_key)

    original_apply = _patches.original("keras.src.optimizers.base_optimizer:BaseOptimizer.apply")

    def apply(self, grads, trainable_variables=None):
        variables = trainable_variables if trainable_variables is not None else (
            self._trainable_variables if self.built else None)
        if variables is not None:
            variables = list(variables)
            if any(_is_padded(v) for v in variables):
                # the gradient of padded storage has the padded shape: cut it to the variable's
                grads = [None if g is None else _variables.unpad(v._value, _dense(g)) if _is_padded(v) else g
                         for g, v in zip(grads, variables)]
            trainable_variables = variables if trainable_variables is not None else None
        return original_apply(self, grads, trainable_variables)

    _patches.install("keras.src.optimizers.base_optimizer:BaseOptimizer.apply", apply)

    base = "keras.src.optimizers.base_optimizer:BaseOptimizer.build"
    original_build = _patches.original(base)

    def build(self, variables):
        original_build(self, variables)
        _join_mesh(self, variables)

    _patches.install(base, build)


def _shares_host_cpu(mesh: dtensor.Mesh) -> bool:
    """Whether ``mesh`` is CPU devices of which each client holds several: logical devices that
    split one host's cores (``tfdist.virtual_cpus``, ``tfdist run --devices-per-proc``)."""
    return mesh.device_type().upper() == "CPU" and mesh.num_local_devices() > 1


# Parameters from this many elements up have their slots sharded under DataParallel on a
# shared host: below it one all-gather's fixed latency (~2 ms on 8 virtual CPUs) costs more
# than the replicated update it saves (~12 ns per element over 8 replicas).  Measured: W1's
# 1M-element kernels gain (benchmarks/compare.py); W2's weights, all under 65K elements, went
# from 75 to 134 ms per step with every slot sharded (docs/design.md).
SHARDED_SLOT_MIN_ELEMENTS = 1 << 18


def _shared_host_slot_layout(param_layout: dtensor.Layout):
    """Slot layouts for ``keras.distribution.DataParallel`` on devices that share a host's CPU.

    There the replicated update (Keras' DataParallel keeps the optimizer state whole on every
    device) repeats the same arithmetic on every logical device, on the same cores; sharding
    the state of large parameters over the batch dim (ZeRO stage 1) does each element's update
    once and all-gathers the new parameter -- fewer cycles and 1/N of their state in the
    host's memory.  On GPUs and TPUs, where each device has its own compute and the extra
    all-gather costs bytes, the state stays replicated as Keras lays it out.
    """
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel) or not _shares_host_cpu(param_layout.mesh):
        return None
    shard = sharded_slot_layout(distribution.batch_dim_name)

    def layout(of_param: dtensor.Layout, shape: tuple[int, ...]) -> dtensor.Layout:
        if int(np.prod(shape, dtype=np.int64)) < SHARDED_SLOT_MIN_ELEMENTS:
            return of_param
        return shard(of_param, shape)

    return layout


def _join_mesh(optimizer, variables) -> None:
    """The optimizer's own variables (iterations, learning rate) go to the mesh it trains on.

    They are made when the optimizer is constructed, usually outside any
    distribution (each parallelized model has its own, see
    tfdist.keras._modules); a step that mixes them with DVariables fails in
    TF DTensor.  Replicated on the parameters' mesh they are what Keras
    would have made under that model's distribution.
    """
    meshes = {_variables.layout_of(v._value).mesh for v in variables if _variables.is_dtensor_variable(v)}
    if len(meshes) != 1:
        return
    mesh = meshes.pop()
    with tf.init_scope():
        for variable in optimizer.variables:
            if not _variables.is_dtensor_variable(variable):
                _variables.to_dvariable(variable, dtensor.Layout.replicated(mesh, len(variable.shape)))
