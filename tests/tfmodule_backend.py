"""A second model framework for tfdist, made of plain ``tf.Module``s, and its ModuleBackend.

It proves the seam (``tfdist.tensor._modules.ModuleBackend``): ``parallelize_module``
and ``fully_shard`` run on these modules with no change to ``tfdist.tensor`` or
``tfdist.fsdp``, and nothing here imports Keras.  The framework is torch-shaped:
a ``Param`` is a weight (it holds a ``tf.Variable`` the backend may swap for a
``DVariable``, as torch swaps ``nn.Parameter`` data), a ``Layer`` owns params
and child layers and is called through ``__call__``.

Example::

    model = Sequential("mlp", [Linear("up", 16, 32, activation=tf.nn.relu), Linear("down", 32, 8)])
    tfdist.tensor.parallel.parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    y = model(x)
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._modules import LayerKind, Pending, register_module_backend, with_hooks

# (id(param) -> tensor) while a backend ``read_as`` block runs (this thread / task)
_READS: contextvars.ContextVar[dict[int, tf.Tensor]] = contextvars.ContextVar("tfmodule_reads", default={})


class Param(tf.Module):
    """A weight: a variable that may be replaced by one on a mesh."""

    def __init__(self, name: str, value: np.ndarray) -> None:
        super().__init__(name=name)
        self.var = tf.Variable(value, name=name)

    @property
    def shape(self) -> tf.TensorShape:
        return self.var.shape

    @property
    def dtype(self) -> tf.DType:
        return self.var.dtype

    def read(self) -> tf.Tensor:
        override = _READS.get().get(id(self))
        return override if override is not None else tf.convert_to_tensor(self.var)


tf.register_tensor_conversion_function(Param, lambda p, dtype=None, name=None, as_ref=False: p.read())


class Layer(tf.Module):
    """Calls go ``__call__`` -> ``call`` (hooks may wrap it per instance) -> ``base`` (the layer's own math)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.layer_name = name
        self.base: Callable[..., Any] = self.forward
        self.call: Callable[..., Any] = lambda *args, **kwargs: self.base(*args, **kwargs)
        self.call_was_replaced = False
        self.mesh: DeviceMesh | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def params(self) -> dict[str, Param]:
        return {}

    def children(self) -> list[tuple[str, "Layer"]]:
        return []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)


class Linear(Layer):
    """``activation(x @ kernel + bias)``."""

    def __init__(self, name: str, n_in: int, n_out: int, activation: Callable | None = None, seed: int = 0) -> None:
        super().__init__(name)
        rng = np.random.default_rng(seed)
        self.kernel = Param("kernel", (rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)).astype(np.float32))
        self.bias = Param("bias", (rng.normal(size=(n_out,)) * 0.1).astype(np.float32))
        self.activation = activation

    def forward(self, x: tf.Tensor) -> tf.Tensor:
        y = tf.matmul(x, self.kernel.read()) + self.bias.read()
        return self.activation(y) if self.activation is not None else y

    def params(self) -> dict[str, Param]:
        return {"kernel": self.kernel, "bias": self.bias}


class Sequential(Layer):
    def __init__(self, name: str, layers: list[Layer]) -> None:
        super().__init__(name)
        self.layers = list(layers)

    def forward(self, x: tf.Tensor) -> tf.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def children(self) -> list[tuple[str, Layer]]:
        return [(layer.layer_name, layer) for layer in self.layers]


def _to_dtensor(value: tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    if not dtensor.is_dtensor(value):
        value = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.relayout(value, layout)


class TFModuleBackend:
    """tfdist's ModuleBackend for the framework above."""

    name = "tfmodule"

    def named_layers(self, module: Layer) -> Iterator[tuple[str, Any]]:
        def visit(prefix: str, layer: Layer):
            yield prefix, layer
            for name, child in layer.children():
                yield from visit(f"{prefix}.{name}" if prefix else name, child)

        yield from visit("", module)

    def layer_name(self, layer: Layer) -> str:
        return layer.layer_name

    def is_built(self, layer: Layer) -> bool:
        return True  # every layer makes its params in __init__

    def layer_kind(self, layer: Layer) -> LayerKind:
        if type(layer) is Linear:
            return LayerKind("dense", use_bias=True, activation=layer.activation, compute_dtype=layer.kernel.dtype.name)
        return LayerKind("other", use_bias=False)

    def weights(self, layer: Layer) -> dict[str, Param]:
        return layer.params()

    def variables(self, module: Layer) -> list[Param]:
        return [p for _, layer in self.named_layers(module) for p in layer.params().values()]

    all_weights = variables

    def frozen_weights(self, module: Layer) -> list[Param]:
        return []  # no layer of this framework is frozen

    def optimizer_scalars(self, optimizer: Any) -> dict[str, Any]:
        return {"iterations": optimizer.iterations}

    def set_weight_layout(self, layer: Layer, name: str, layout_fn: Callable[[int], dtensor.Layout]) -> None:
        param = layer.params()[name]
        self.place_variable(param, layout_fn(len(param.shape)))

    def batch_norm_classes(self) -> tuple[type, ...]:
        return ()  # the framework above has no batch norm

    def is_trainable(self, variable: Param) -> bool:
        return True  # every param of this framework is trained

    def check_layout(self, variable: Param, layout: dtensor.Layout) -> None:
        for d, spec in enumerate(layout.sharding_specs):
            if spec != dtensor.UNSHARDED and variable.shape[d] % layout.mesh.dim_size(spec):
                raise ValueError(f"{variable.name}: dim {d} of {variable.shape} does not split over {spec!r}")

    def place_variable(self, variable: Param, layout: dtensor.Layout) -> None:
        variable.var = dtensor.DVariable(_to_dtensor(tf.convert_to_tensor(variable.var), layout), name=variable.name)

    def is_placed(self, variable: Param) -> bool:
        return isinstance(variable.var, dtensor.DVariable)

    def variable_layout(self, variable: Param) -> dtensor.Layout | None:
        return variable.var.layout if self.is_placed(variable) else None

    def stored_value(self, variable: Param) -> tf.Tensor:
        return tf.convert_to_tensor(variable.var)

    @contextlib.contextmanager
    def read_as(self, values: list[tuple[Param, tf.Tensor]]) -> Iterator[None]:
        token = _READS.set({**_READS.get(), **{id(p): t for p, t in values}})
        try:
            yield
        finally:
            _READS.reset(token)

    def call_replaced(self, layer: Layer) -> bool:
        return layer.call_was_replaced

    def defer(self, pending: Pending, apply: Callable[[Any], None]) -> None:
        raise TypeError("tfmodule layers make their params in __init__: nothing is pending")

    def wrap_call(self, layer: Layer, before: Callable | None, after: Callable | None) -> None:
        layer.call = with_hooks(layer.call, before, after)

    def replace_call(self, layer: Layer, call: Callable[..., Any]) -> None:
        original = layer.call
        layer.call = lambda *args, **kwargs: call(original, *args, **kwargs)
        layer.call_was_replaced = True

    def replace_inner_call(self, layer: Layer, call: Callable[..., Any]) -> None:
        base = layer.base
        layer.base = lambda *args, **kwargs: call(base, *args, **kwargs)

    def is_symbolic(self, x: Any) -> bool:
        return False  # eager or traced tensors only: no symbolic build

    def attach_mesh(self, module: Layer, mesh: DeviceMesh, batch_axis: int | None) -> None:
        module.mesh = mesh  # no variable is created later (no optimizer slots inside the module)

    def sharded_loss_scope(self, cross_entropy: Callable[..., Any]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the framework has no loss function of its own to redirect

    def attention_scope(self, relayout_qkv: Callable[[Any, Any, Any], tuple]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # nor an attention layer


register_module_backend(__name__.split(".")[0], TFModuleBackend())
