"""How a layer in a ``fully_shard`` group computes with its sharded parameters.

One rule per kind of layer, chosen once when the layer is hooked (``layer_call``):

- an Embedding looks up its rows in the sharded table (``sharded_lookup``);
- a norm or another leaf layer whose weights are all FSDP parameters runs per data-parallel
  shard (``per_shard_call``), so its weight gradients are reduce-scattered;
- a Dense or EinsumDense computes its product as the einsum ``LayerKind.equation_for`` gives,
  with the bias's output letters (``sharded_einsum``): a reduce-scattered gradient, and with
  ``reshard_after_forward`` the kernel gathered again in the backward;
- any other layer reads its gathered parameters (``gathered_call``); TF then all-reduces its
  gradient inside the consuming op and FSDP keeps the local slice.

Every route reads a parameter through ``_shard``, where the group's all-reduce hook and gradient
divide factor apply once for all of them.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.fsdp._collectives import (
    ShardedParam, gathered_with_sliced_grad, per_shard_call, sharded_einsum, sharded_lookup,
)
from tfdist.fsdp._fsdp_module import FSDPState
from tfdist.tensor._modules import ModuleBackend
from tfdist.tensor.parallel.style import as_tf, batch_replicated, on_mesh

__all__ = ["gathered_call", "hook_layers", "layer_call"]


def _shard(modules: ModuleBackend, variable: Any, param: ShardedParam, state: FSDPState) -> tf.Tensor:
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


def hook_layers(modules: ModuleBackend, plans: list, state: FSDPState) -> None:
    by_layer: dict[int, tuple[Any, dict[str, tuple[Any, ShardedParam]]]] = {}
    for layer, name, variable, param in plans:
        by_layer.setdefault(id(layer), (layer, {}))[1][name] = (variable, param)
    for layer, params in by_layer.values():
        call, inner = layer_call(modules, layer, params, state)
        (modules.replace_inner_call if inner else modules.replace_call)(layer, call)


def layer_call(modules: ModuleBackend, layer: Any, params: dict, state: FSDPState) -> tuple[Callable, bool]:
    """The FSDP computation for ``layer`` and whether it replaces the innermost call."""
    if _is_plain_lookup(modules, layer, params):
        return _sharded_lookup_call(modules, layer, params, state), True
    if _runs_per_shard(modules, layer, params):
        return _per_shard_layer_call(modules, layer, params, state), True
    letters = _bias_letters(modules, layer, params)
    if letters is not None:
        return _sharded_product_call(modules, layer, params, state, letters), True
    # a tensor-parallel product that reads the weights itself is wrapped from outside
    return gathered_call(modules, params, state), not modules.call_replaced(layer)


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
    modules: ModuleBackend, layer: Any, params: dict, state: FSDPState, letters: str,
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


def _sharded_lookup_call(modules: ModuleBackend, layer: Any, params: dict, state: FSDPState) -> Callable:
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


def _per_shard_layer_call(modules: ModuleBackend, layer: Any, params: dict, state: FSDPState) -> Callable:
    """The layer's own computation run per data-parallel shard: its weight gradients are
    reduce-scattered (torch's bytes) where TF would all-reduce them.  A call with more than one
    tensor, a batch that does not split, or an op TF cannot vectorise takes the gathered route; so
    does a lookup (integer input): the gradient of TF's vectorised gather is a segment sum over the
    stacked copies that TF DTensor all-reduces whole (N x the table's bytes)."""
    pairs = list(params.values())
    gathered = gathered_call(modules, params, state)
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


def gathered_call(modules: ModuleBackend, params: dict, state: FSDPState) -> Callable:
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
