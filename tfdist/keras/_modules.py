"""Keras 3 layers as torch modules: tfdist.tensor's ModuleBackend for Keras.

FQNs follow torch: attribute names joined by dots (``blocks.0.mlp.up``); in
a Sequential or functional model a child is named by its layer name; the
projections of a ``MultiHeadAttention`` are ``query``, ``key``, ``value``
and ``output``.  Hooks are per instance (``layer.call``/``layer.build`` of
that one layer), never on a Keras class.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _patches, _registry
from tfdist.device_mesh import DeviceMesh
from tfdist.keras import _offload_step, _variables
from tfdist.keras._backend import tfdist_mesh
from tfdist.keras._distribution import MeshDistribution
from tfdist.keras._keras_internals import Functional
from tfdist.tensor._modules import LayerKind, Pending, register_module_backend, with_hooks
from tfdist.tensor.parallel.style import replicated_batch

__all__ = ["KerasModules"]

_MHA_CHILDREN = {"query": "_query_dense", "key": "_key_dense", "value": "_value_dense", "output": "_output_dense"}
_DEFERRED: "weakref.WeakKeyDictionary[Any, list[Callable[[], None]]]" = weakref.WeakKeyDictionary()


def _public_property_of(cls: type, name: str) -> bool:
    """``cls`` has a property ``name`` defined by a class outside Keras (Keras' own, like
    ``Model.layers`` over ``_layers``, are its bookkeeping)."""
    if name.startswith("_"):
        return False
    for klass in cls.__mro__:
        if name in vars(klass):
            return isinstance(vars(klass)[name], property) and not klass.__module__.startswith("keras.")
    return False


def _children(layer: Any) -> list[tuple[str, Any]]:
    """A layer's sublayers by torch-style name: its attributes (a private ``_x`` under the public
    name ``x`` where the class has that property, as keras-hub's backbones and tasks keep their
    parts), then the rest of a functional model's graph by layer name."""
    if isinstance(layer, keras.layers.MultiHeadAttention):
        if not layer.built:
            return [(k, Pending(layer, v)) for k, v in _MHA_CHILDREN.items()]
        return [(k, getattr(layer, v)) for k, v in _MHA_CHILDREN.items() if getattr(layer, v, None) is not None]
    if isinstance(layer, keras.Sequential):
        return [(child.name, child) for child in layer.layers]
    out = []
    for name, value in vars(layer).items():
        if name.startswith("_"):
            if not isinstance(value, keras.layers.Layer) or not _public_property_of(type(layer), name[1:]):
                continue
            name = name[1:]
        if isinstance(value, keras.layers.Layer):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            out += [(f"{name}.{i}", v) for i, v in enumerate(value) if isinstance(v, keras.layers.Layer)]
        elif isinstance(value, dict):
            out += [(f"{name}.{k}", v) for k, v in value.items() if isinstance(v, keras.layers.Layer)]
    if isinstance(layer, Functional) or getattr(layer, "_is_graph_network", False):
        named = {id(child) for _, child in out}
        out += [(child.name, child) for child in layer.layers if id(child) not in named]
    # sublayers Keras tracks that no public name reaches (keras-hub's Llama decoder keeps its parts
    # in private attributes with no property): by their attribute name, as torch names a module
    named = {id(child) for _, child in out}
    private = {id(v): k for k, v in vars(layer).items() if isinstance(v, keras.layers.Layer)}
    for child in layer._flatten_layers(include_self=False, recursive=False):
        if id(child) not in named:
            named.add(id(child))
            out.append((private.get(id(child), child.name), child))
    return out


_NORMS = tuple(
    k for k in (keras.layers.LayerNormalization, getattr(keras.layers, "RMSNormalization", None)) if k is not None
)


# Methods that may create variables (builds, metrics, optimizer state) or feed batches.
_SCOPED_METHODS = (
    "build", "call", "compile", "fit", "evaluate", "predict",
    "train_on_batch", "test_on_batch", "predict_on_batch",
)


def _own_distribution(module: Any, distribution: Any) -> None:
    """``module`` runs under ``distribution`` whatever the global one is.

    torch keeps a module's mesh on its parameters; Keras reads one global
    distribution when it creates variables.  Each parallelized model gets
    its own (its ``tfdist._registry`` record), made current by
    ``distribution.scope()`` around this instance's building, calling,
    compiling and training methods -- so models on different meshes live in
    one process, and ``keras.distribution.set_distribution`` elsewhere does
    not move them.
    """
    state = _registry.module(module)
    state.distribution = distribution
    for name in _SCOPED_METHODS:
        method = getattr(module, name, None)
        if method is None or name in state.scoped_methods:
            continue
        if name == "call":
            method = _partial_batches_replicated(module, method)

        def scoped(*args, _method=method, **kwargs):
            if keras.distribution.distribution() is state.distribution:
                return _method(*args, **kwargs)
            with state.distribution.scope():
                return _method(*args, **kwargs)

        setattr(module, name, functools.wraps(method)(scoped))  # this instance only
        state.scoped_methods.add(name)


def _partial_batches_replicated(module: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """A call on a batch that does not split over the data-parallel dim runs it replicated
    (``model(x[:1])`` on a 2-way data-parallel mesh; fit/predict do the same)."""

    @functools.wraps(call)
    def checked(*args, **kwargs):
        state = _registry.module(module)
        name = state.batch_dim
        batch = tf.nest.flatten(args[:1])
        if name is None or not batch:
            return call(*args, **kwargs)
        mesh = tfdist_mesh(state.distribution.device_mesh)
        size = getattr(batch[0], "shape", (None,))
        if len(size) and size[0] is not None and size[0] % mesh.size(name):
            with replicated_batch():
                return call(*args, **kwargs)
        return call(*args, **kwargs)

    return checked


def _ensure_base_call(layer: Any) -> None:
    """One indirection under every hook, so the innermost computation can be swapped later
    (FSDP's gathered product inside tensor-parallel relayouts applied before it)."""
    state = _registry.module(layer)
    if state.base_call is None:
        state.base_call = layer.call
        layer.call = functools.wraps(layer.call)(lambda *args, **kwargs: state.base_call(*args, **kwargs))


def _own_call(layer: Any, base: type) -> bool:
    """``layer`` is a ``base`` whose class runs ``base``'s own call."""
    return isinstance(layer, base) and type(layer).call is base.call


def _extension(layer: Any) -> str:
    """What a Keras layer adds to its plain product: a LoRA branch, or a quantized kernel's scale."""
    for attribute in ("lora_enabled", "quantization_mode"):
        value = getattr(layer, attribute, None)
        if value:
            return f"{attribute}={value!r}"
    return ""


class KerasModules:
    """The ModuleBackend for Keras 3 layers and models."""

    name = "keras"

    def named_layers(self, module: Any) -> Iterator[tuple[str, Any]]:
        seen: set[int] = set()

        def visit(prefix: str, layer: Any):
            if id(layer) in seen:
                return
            seen.add(id(layer))
            yield prefix, layer
            if isinstance(layer, Pending):
                return
            for name, child in _children(layer):
                yield from visit(f"{prefix}.{name}" if prefix else name, child)

        yield from visit("", module)

    def layer_name(self, layer: Any) -> str:
        return layer.name

    def is_built(self, layer: Any) -> bool:
        return bool(getattr(layer, "built", False))

    def layer_kind(self, layer: Any) -> LayerKind:
        """What a layer computes, known only where its class keeps the Keras base's ``call``.

        A subclass that overrides ``call`` (keras-hub's ReversibleEmbedding,
        which also multiplies by the transposed table) computes something
        else: it is an "other" layer, run as its own code.
        """
        use_bias = bool(getattr(layer, "use_bias", True))
        facts = dict(extended_by=_extension(layer), compute_dtype=getattr(layer, "compute_dtype", None))
        if _own_call(layer, keras.layers.EinsumDense):
            return LayerKind("einsum", use_bias=bool(layer.bias_axes), equation=layer.equation.replace(" ", ""),
                             bias_axes=layer.bias_axes or "", activation=layer.activation, **facts)
        if _own_call(layer, keras.layers.Embedding):
            return LayerKind("embedding", use_bias=False, num_embeddings=int(layer.input_dim), **facts)
        if _own_call(layer, keras.layers.Dense):
            return LayerKind("dense", use_bias=use_bias, activation=layer.activation, **facts)
        if isinstance(layer, _NORMS) and any(_own_call(layer, base) for base in _NORMS):
            return LayerKind("norm", use_bias=use_bias)
        if isinstance(layer, keras.layers.Dropout):
            return LayerKind("dropout", use_bias=False)
        if _own_call(layer, keras.layers.MultiHeadAttention):
            return LayerKind("attention", use_bias=use_bias)
        return LayerKind("other", use_bias=use_bias)

    def weights(self, layer: Any) -> dict[str, Any]:
        return {v.name: v for v in layer._trainable_variables + layer._non_trainable_variables}

    def all_weights(self, module: Any) -> list[Any]:
        return list(module.weights)

    def frozen_weights(self, module: Any) -> list[Any]:
        return [v for _, layer in self.named_layers(module)
                if not isinstance(layer, Pending) and layer.trainable is False for v in layer.weights]

    def optimizer_scalars(self, optimizer: Any) -> dict[str, Any]:
        out = {"iterations": optimizer.iterations}
        lr = getattr(optimizer, "_learning_rate", None)  # a variable, or a schedule called with the step
        if hasattr(lr, "assign"):
            out["learning_rate"] = lr
        return out

    def variables(self, module: Any) -> list[Any]:
        """The module's variables and, when compiled, its metrics' (the loss tracker)."""
        out, seen = [], set()
        for v in list(getattr(module, "variables", [])) + list(getattr(module, "metrics_variables", [])):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    def set_weight_layout(self, layer: Any, name: str, layout_fn: Callable[[int], dtensor.Layout]) -> None:
        if layer.built:
            weights = self.weights(layer)
            if name not in weights:
                raise ValueError(f"layer {layer.name!r} has no weight {name!r}; it has {sorted(weights)}")
            variable = weights[name]
            if getattr(variable, "_value", None) is None:
                # created in a stateless (symbolic) build: laid out when Keras initialises it
                _registry.variable(variable).layout_fn = layout_fn
            else:
                _variables.to_dvariable(variable, layout_fn(len(variable.shape)))
        else:
            _registry.module(layer).weight_layouts[name] = layout_fn

    def batch_norm_classes(self) -> tuple[type, ...]:
        return (keras.layers.BatchNormalization,)

    def is_trainable(self, variable: Any) -> bool:
        return bool(variable.trainable)

    def check_layout(self, variable: Any, layout: dtensor.Layout) -> None:
        # A parallel style shards the layer's activations like its weights; an uneven weight dim
        # would make an uneven activation dim, which the styles' Keras calls do not carry. (A
        # layout map's uneven variable is stored padded: _variables.make_dvariable.)
        shape = tuple(variable.shape)
        mesh_shape = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
        for d, spec in enumerate(layout.sharding_specs):
            if spec in mesh_shape and shape[d] % mesh_shape[spec]:
                raise ValueError(
                    f"variable '{variable.path}' has shape {shape}; dim {d} ({shape[d]}) "
                    f"is not divisible by mesh dim {spec!r} of size {mesh_shape[spec]}. "
                    "A parallel style needs even shards: choose a size divisible by the "
                    "mesh dim, or give this layer a layout map entry (stored padded)."
                )

    def place_variable(self, variable: Any, layout: dtensor.Layout) -> None:
        _variables.to_dvariable(variable, layout)

    def offload_variable(self, variable: Any, layout: dtensor.Layout) -> None:
        _variables.offload(variable, layout)

    def device_copies_for_call(self, variables: list[Any], what: str) -> contextlib.AbstractContextManager:
        return _offload_step.device_copies_for_call(variables, what)

    def is_placed(self, variable: Any) -> bool:
        return _variables.is_dtensor_variable(variable)

    def new_variable(self, value: tf.Tensor, layout: dtensor.Layout, name: str, trainable: bool) -> Any:
        variable = keras.Variable(value, trainable=trainable, name=name, dtype=value.dtype.name)
        _variables.to_dvariable(variable, layout)
        return variable

    def variable_layout(self, variable: Any) -> dtensor.Layout | None:
        if not _variables.is_dtensor_variable(variable):
            return None
        return _variables.value_layout(variable._value)

    def stored_value(self, variable: Any) -> Any:
        inner = variable._value
        if isinstance(inner, dtensor.DVariable):
            return _variables.current_value(inner)
        return tf.convert_to_tensor(inner)

    def read_as(self, values: list[tuple[Any, Any]]) -> contextlib.AbstractContextManager:
        return _variables.reads_as(values)

    def call_replaced(self, layer: Any) -> bool:
        state = _registry.module_if_any(layer)
        return state is not None and state.call_replaced

    def defer(self, pending: Pending, apply: Callable[[Any], None]) -> None:
        parent = pending.parent
        hooks = _DEFERRED.get(parent)
        if hooks is None:
            hooks = _DEFERRED[parent] = []
            original_build = parent.build

            @functools.wraps(original_build)
            def build(*args, **kwargs):
                original_build(*args, **kwargs)
                for hook in _DEFERRED.pop(parent, []):
                    hook()

            parent.build = build  # this instance only
        hooks.append(lambda: apply(getattr(parent, pending.attr)))

    def wrap_call(self, layer: Any, before: Callable | None, after: Callable | None) -> None:
        _ensure_base_call(layer)
        layer.call = with_hooks(layer.call, before, after)  # this instance only

    def replace_call(self, layer: Any, call: Callable[..., Any]) -> None:
        _ensure_base_call(layer)
        original = layer.call
        layer.call = functools.wraps(original)(lambda *args, **kwargs: call(original, *args, **kwargs))
        _registry.module(layer).call_replaced = True

    def replace_inner_call(self, layer: Any, call: Callable[..., Any]) -> None:
        _ensure_base_call(layer)
        state = _registry.module(layer)
        base = state.base_call
        state.base_call = functools.wraps(base)(lambda *args, **kwargs: call(base, *args, **kwargs))

    def is_symbolic(self, x: Any) -> bool:
        return isinstance(x, keras.KerasTensor)

    def attach_mesh(self, module: Any, mesh: DeviceMesh, batch_axis: int | None) -> None:
        """Gives ``module`` its own distribution on ``mesh`` (see ``_own_distribution``)."""
        optimizer = getattr(module, "optimizer", None)
        own = _registry.distribution_of(module)
        first = own is None
        if first and optimizer is not None and getattr(optimizer, "built", False):
            raise ValueError(
                f"{module.name!r} has trained already: its optimizer state was made for the unsharded "
                "weights. Call parallelize_module before the first fit/train step, or compile again "
                "with a new optimizer first (model.compile(optimizer=keras.optimizers.Adam(...), ...))."
            )
        root = mesh.root_mesh
        if own is not None and tfdist_mesh(own.device_mesh).to_tf() != root.to_tf():
            raise ValueError(
                f"{module.name!r} is already parallelized on mesh {tfdist_mesh(own.device_mesh)!r}; "
                f"a model never changes mesh. Build a new model for device_mesh {mesh!r}."
            )
        if own is None:
            current = keras.distribution.distribution()
            if current is not None and tfdist_mesh(current.device_mesh).to_tf() == root.to_tf():
                own = current  # the user's distribution on this mesh (its layout map, batch dim)
            else:
                name = root.axis_names[batch_axis] if batch_axis is not None else None
                own = MeshDistribution(root, batch_dim_name=name)
            _own_distribution(module, own)
        if batch_axis is not None:
            _registry.module(module).batch_dim = root.axis_names[batch_axis]

    # -- with-block behaviours of tfdist.tensor APIs ------------------------------
    def sharded_loss_scope(self, cross_entropy: Callable[..., tf.Tensor]) -> contextlib.AbstractContextManager:
        """Keras' sparse cross-entropy computed by ``cross_entropy(labels, logits, axis)``."""

        def keras_ce(original, target, output, from_logits=False, axis=-1):
            output = tf.convert_to_tensor(output)
            if not from_logits:
                output = tf.math.log(tf.clip_by_value(output, 1e-7, 1.0 - 1e-7))
            target = tf.convert_to_tensor(target)
            if target.dtype.is_floating:  # Keras takes float class ids and casts them
                target = tf.cast(target, tf.int32)
            if target.shape.rank == output.shape.rank:  # Keras allows a trailing 1
                target = tf.squeeze(target, axis=-1)
            return cross_entropy(target, output, axis)

        return _patches.scoped("keras.src.backend.tensorflow.nn:sparse_categorical_crossentropy", keras_ce)

    def attention_scope(self, relayout_qkv: Callable[[Any, Any, Any], tuple]) -> contextlib.AbstractContextManager:
        """Every MultiHeadAttention's query/key/value pass through ``relayout_qkv`` first."""

        def compute_attention(original, layer, query, key, value, *args, **kwargs):
            query, key, value = relayout_qkv(query, key, value)
            return original(layer, query, key, value, *args, **kwargs)

        return _patches.scoped(
            "keras.src.layers.attention.multi_head_attention:MultiHeadAttention._compute_attention",
            compute_attention,
        )


register_module_backend("keras", KerasModules())
