"""fit / evaluate / predict of a model whose FSDP parameters are offloaded to the host mesh.

torch's CPU offload keeps parameters, gradients and optimizer state in host
memory, copies the parameter shards to the device for forward and backward,
the gradient shards back, and runs the optimizer step on the CPU.  Here one
Keras step becomes three parts (``tfdist.fsdp._offload`` says where shards live):

1. before the step: each offloaded parameter's shards copied to the device mesh
   (``copy_shards``, each device's own shard: no gather);
2. the device program: Keras' forward, loss and backward with every read of an
   offloaded parameter served by its copy (``reads_device_copies``); its
   outputs are the logs and the gradient shards (FSDP's reduce-scatter as usual);
3. after it: the gradient shards copied to the host mesh, and the optimizer's
   ``apply_gradients`` run as a program on the host mesh, where its slots live.

Between steps the device mesh holds none of the offloaded parameters, their
gradients or their optimizer state.  Only Keras' own ``train_step`` is split
this way: a model that overrides it is refused by name, since its optimizer
call could not be moved to the host.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import tensorflow as tf
from keras import tree
from tensorflow.experimental import dtensor
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops

from tfdist.fsdp import _offload
from tfdist.keras import _data, _variables
from tfdist.keras._backend import traced_like_keras
from tfdist.keras._keras_internals import TensorFlowTrainer, data_adapter_utils, loss_module

__all__ = ["offloaded_variables", "offloaded_steps", "device_copies_for_call"]


def offloaded_variables(model: Any) -> list[Any]:
    """The model's variables stored on a host mesh (CPU offload), in ``model.variables`` order."""
    return [v for v in model.variables if _offload.is_offloaded(v)]


def _to_device(variables: list[Any]) -> list[tf.Tensor]:
    return [_offload.copy_shards(v._value.read_value(), _offload.device_layout(v)) for v in variables]


def _to_host(grads: list[Any], variables: list[Any]) -> list[Any]:
    out = []
    for grad, variable in zip(grads, variables):
        if grad is None:
            out.append(None)
            continue
        device = _offload.device_layout(variable)
        if dtensor.fetch_layout(grad) != device:  # a route whose gradient came out in another layout
            grad = dtensor.relayout(grad, device)
        out.append(_offload.copy_shards(grad, _offload.host_layout(device)))
    return out


def _check_split(model: Any, variables: list[Any]) -> None:
    if type(model).train_step is not TensorFlowTrainer.train_step:
        raise NotImplementedError(
            f"CPU offload: {type(model).__name__} overrides train_step, whose optimizer call would run on "
            "the device mesh, where offloaded parameters do not live. fit splits Keras' own train_step "
            "(device forward/backward, host optimizer step); use it, or OffloadPolicy().")
    offloaded = {id(v) for v in variables}
    rest = [v.path for v in model.trainable_variables if id(v) not in offloaded]
    if rest:
        raise NotImplementedError(
            f"CPU offload: model {model.name!r} offloads some trainable variables but not {rest[:6]}"
            f"{' ...' if len(rest) > 6 else ''}; one optimizer step cannot run on both meshes. Pass "
            "offload_policy=CPUOffloadPolicy() to every fully_shard call of the model (the root's "
            "groups the rest).")


def _read_program(step_function: Callable, variables: list[Any]) -> Callable:
    """``step_function(data)`` as a program of ``(data, copies)`` reading the copies."""
    dvariables = [v._value for v in variables]

    def program(packed):
        data, copies = packed
        with _variables.reads_device_copies(list(zip(dvariables, copies))):
            return step_function(data)

    return program


def _train_program(model: Any, variables: list[Any]) -> Callable:
    """Keras' ``train_step`` (``keras/src/backend/tensorflow/trainer.py``) up to its gradients: the
    program returns ``(logs, gradient shards)`` and leaves the optimizer to the host."""
    dvariables = [v._value for v in variables]

    def program(packed):
        data, copies = packed
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with _variables.reads_device_copies(list(zip(dvariables, copies))):
            with tf.GradientTape() as tape:
                tape.watch(copies)
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
                loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
                model._loss_tracker.update_state(
                    loss_module.unscale_loss_for_distribution(loss),
                    sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0])
                if model.optimizer is not None:
                    loss = model.optimizer.scale_loss(loss)
            grads = tape.gradient(loss, copies)
            logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        # an Embedding's IndexedSlices: dense, the layout its shard is copied in
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return logs, grads

    return program


def _host_apply(model: Any, variables: list[Any], run_eagerly: bool) -> Callable:
    """The optimizer step as a program on the host mesh (torch runs it on the CPU).  The
    optimizer's own variables (its step count, a learning-rate variable) join the host mesh
    first; its slots are made there, from the offloaded parameters' layouts."""
    optimizer = model.optimizer
    host = _offload.host_mesh(_offload.device_layout(variables[0]).mesh)
    for variable in optimizer.variables:
        inner = getattr(variable, "_value", None)
        if isinstance(inner, dtensor.DVariable) and _variables.layout_of(inner).mesh != host:
            layout = _variables.layout_of(inner)
            value = _offload.copy_shards(inner.read_value(), _offload.host_layout(layout))
            variable._value = _variables.new_dvariable(value, _offload.host_layout(layout),
                                                       trainable=variable.trainable, name=variable.name)

    def apply(grads):
        optimizer.apply_gradients(zip(grads, variables))

    return apply if run_eagerly else traced_like_keras(apply)


def offloaded_steps(model: Any, step_function: Callable, split: Callable[..., Callable],
                    mesh: Any, batch_axis: int | None) -> Callable:
    """``step(data, splits_evenly=None)`` for an offloaded model: copies in, the device program
    (``split`` of it: tfdist's per-batch-split traced step), and for training the host step."""
    variables = offloaded_variables(model)
    training = getattr(step_function, "__func__", None) is TensorFlowTrainer.train_step or (
        step_function == model.train_step)
    if training:
        _check_split(model, variables)
        device_step = split(_train_program(model, variables), combine=False)  # it returns gradients
        apply = _host_apply(model, variables, model.run_eagerly)
    else:
        device_step, apply = split(_read_program(step_function, variables)), None

    def step(data, splits_evenly=None):
        if splits_evenly is None:  # host batches (predict): split here, the copies are placed already
            splits_evenly = _data.splits_evenly(data, mesh, batch_axis)
            data = _data.shard_batch(data, mesh, batch_axis)
        outputs = device_step((data, _to_device(variables)), splits_evenly)
        if apply is None:
            return outputs
        logs, grads = outputs
        apply(_to_host(list(grads), variables))
        return logs

    step.traced = getattr(device_step, "traced", None)
    return step


@contextlib.contextmanager
def device_copies_for_call(variables: list[Any], what: str):
    """An eager call of an offloaded module: its parameters copied to the device mesh for the
    call (torch's forward copies them in too).  A traced call outside fit/evaluate/predict has no
    such copies and is refused: the copies are made between programs, not inside one."""
    pending = [v for v in variables if not _variables.has_device_copy(v._value)]
    if not pending:
        yield
        return
    if not tf.executing_eagerly():
        raise NotImplementedError(
            f"CPU offload: {what} is called inside a tf.function of your own, but its parameters live "
            "on the host mesh and TF DTensor cannot copy a shard between meshes inside a program. Train "
            "with fit / evaluate / predict (which copy the shards between programs), or call the model "
            "eagerly.")
    copies = [_recorded_copy(v) for v in pending]
    with _variables.reads_device_copies(list(zip([v._value for v in pending], copies))):
        yield


def _recorded_copy(variable: Any) -> tf.Tensor:
    """The device copy of ``variable`` for an eager call; under an eager tape it is recorded as one
    operation of the variable whose gradient is the copy's, copied back to the host mesh (a tape
    over the copy's own ops would carry a host-mesh gradient into device-mesh ops)."""
    with record.stop_recording():
        copy = _to_device([variable])[0]
    if record.could_possibly_record():
        resource_variable_ops.variable_accessed(variable._value)  # what an eager read tells the tape

        def gradient(grad):
            grad = tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad
            return [_to_host([grad], [variable])[0]]

        record.record_operation("TfdistOffloadedCopy", [copy], [variable._value.handle], gradient)
    return copy
