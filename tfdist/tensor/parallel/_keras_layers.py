"""Keras layers as torch modules: fully qualified names, weights, call hooks.

Kept apart from the styles so that only this module knows Keras internals.
FQNs follow torch: attribute names joined by dots (``blocks.0.mlp.up``); in
a Sequential or functional model a child is named by its layer name; the
projections of a ``MultiHeadAttention`` are ``query``, ``key``, ``value``
and ``output``.
"""

from __future__ import annotations

import functools
import re
import weakref
from typing import Any, Callable, Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = ["named_layers", "match_plan", "set_weight_layout", "wrap_call", "weight_names"]

_MHA_CHILDREN = {"query": "_query_dense", "key": "_key_dense", "value": "_value_dense", "output": "_output_dense"}


def _keras():
    import keras

    return keras


class Pending:
    """A sublayer that its parent creates when it builds (an unbuilt MultiHeadAttention's projections)."""

    def __init__(self, parent: Any, attr: str) -> None:
        self.parent, self.attr = parent, attr


_DEFERRED: "weakref.WeakKeyDictionary[Any, list[Callable[[], None]]]" = weakref.WeakKeyDictionary()


def defer(pending: Pending, apply: Callable[[Any], None]) -> None:
    """Runs ``apply(sublayer)`` right after ``pending.parent`` builds."""
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

        parent.build = build
    hooks.append(lambda: apply(getattr(parent, pending.attr)))


def _children(layer: Any) -> list[tuple[str, Any]]:
    keras = _keras()
    Layer = keras.layers.Layer
    if isinstance(layer, keras.layers.MultiHeadAttention):
        if not layer.built:
            return [(k, Pending(layer, v)) for k, v in _MHA_CHILDREN.items()]
        return [(k, getattr(layer, v)) for k, v in _MHA_CHILDREN.items() if getattr(layer, v, None) is not None]
    if isinstance(layer, (keras.Sequential,)) or getattr(layer, "_is_graph_network", False) or (
        isinstance(layer, keras.Model) and type(layer).__name__ == "Functional"
    ):
        return [(child.name, child) for child in layer.layers]
    out = []
    for name, value in vars(layer).items():
        if name.startswith("_"):
            continue
        if isinstance(value, Layer):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            out += [(f"{name}.{i}", v) for i, v in enumerate(value) if isinstance(v, Layer)]
        elif isinstance(value, dict):
            out += [(f"{name}.{k}", v) for k, v in value.items() if isinstance(v, Layer)]
    return out


def named_layers(root: Any) -> Iterator[tuple[str, Any]]:
    """(fqn, layer) for ``root`` ("" ) and every sublayer, depth first, each once."""
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

    yield from visit("", root)


def _pattern(key: str) -> re.Pattern:
    parts = [".*" if p == "**" else "[^.]*" if p == "*" else re.escape(p).replace(r"\*", "[^.]*") for p in key.split(".")]
    return re.compile(r"\.".join(parts))


def match_plan(root: Any, plan: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(fqn, layer, style) for every plan key; unmatched keys and double matches are errors."""
    layers = [(fqn, layer) for fqn, layer in named_layers(root) if fqn]
    if "" in plan:
        layers.insert(0, ("", root))
    claimed: dict[int, str] = {}
    out = []
    for key, style in plan.items():
        pattern = _pattern(key) if key else None
        hits = [(fqn, layer) for fqn, layer in layers if (pattern.fullmatch(fqn) if pattern else fqn == "")]
        if not hits:
            names = [fqn for fqn, _ in layers]
            raise ValueError(
                f"parallelize_plan key {key!r} matches no layer, so it would silently stay "
                f"replicated. Layer paths are: {names[:20]}{' ...' if len(names) > 20 else ''}. "
                "Use '*' for one path segment, e.g. 'blocks.*.mlp.up'."
            )
        for fqn, layer in hits:
            if id(layer) in claimed:
                raise ValueError(
                    f"layer {fqn!r} matches plan keys {claimed[id(layer)]!r} and {key!r}; "
                    "each layer may take one style."
                )
            claimed[id(layer)] = key
            out.append((fqn, layer, style))
    return out


def weight_names(layer: Any) -> dict[str, Any]:
    """Name -> Keras variable of a built layer's own weights (kernel, bias, ...)."""
    return {v.name: v for v in layer._trainable_variables + layer._non_trainable_variables}


def set_weight_layout(layer: Any, name: str, layout_fn: Callable[[int], dtensor.Layout]) -> None:
    """Lays out weight ``name`` now (built layer) or when it is created (unbuilt)."""
    from tfdist.keras import _variables

    if layer.built:
        weights = weight_names(layer)
        if name not in weights:
            raise ValueError(f"layer {layer.name!r} has no weight {name!r}; it has {sorted(weights)}")
        variable = weights[name]
        if getattr(variable, "_value", None) is None:
            # created in a stateless (symbolic) build: laid out when Keras initialises it
            variable._tfdist_layout_fn = layout_fn
        else:
            _variables.to_dvariable(variable, layout_fn(len(variable.shape)))
    else:
        pending = dict(getattr(layer, "_tfdist_weight_layouts", {}) or {})
        pending[name] = layout_fn
        layer._tfdist_weight_layouts = pending


def wrap_call(layer: Any, before: Callable | None, after: Callable | None) -> None:
    """Runs ``before(args, kwargs)`` and ``after(outputs)`` around ``layer.call``."""
    original = layer.call

    @functools.wraps(original)
    def call(*args, **kwargs):
        if before is not None:
            args, kwargs = before(args, kwargs)
        outputs = original(*args, **kwargs)
        return after(outputs) if after is not None else outputs

    layer.call = call


def is_symbolic(x: Any) -> bool:
    keras = _keras()
    return isinstance(x, keras.KerasTensor)


def as_tf(x: Any) -> Any:
    """tfdist DTensor -> its TF DTensor; other values unchanged."""
    from tfdist.tensor._api import DTensor

    return x.to_tf() if isinstance(x, DTensor) else x


def on_mesh(x: tf.Tensor, mesh_tf: dtensor.Mesh) -> tf.Tensor:
    """An eager plain tensor copied onto the mesh (replicated); DTensors/graph tensors unchanged."""
    if tf.executing_eagerly() and not dtensor.is_dtensor(x):
        return dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh_tf, x.shape.rank))
    return x
