"""The seam between ``tfdist.tensor`` and model objects (torch's ``nn.Module``).

``tensor/`` speaks placements and TF DTensor.  What it needs of a model --
its layers by path, a layer's weights, the kind of a layer, a hook around a
layer's call, putting a variable on a mesh -- it asks of a
:class:`ModuleBackend`.  ``tfdist.keras`` implements one for Keras 3 and
registers it; ``tensor/`` never imports ``keras`` or ``tfdist.keras``.

Which backend serves an object is decided by the object itself: a Keras
layer's class lives in the ``keras`` package, so the first time a Keras
object reaches ``parallelize_module``/``distribute_module``, the backend
registered for ``"keras"`` is loaded by its module name (a plug-in, as Keras
loads its own backends by name), which keeps ``import tfdist`` free of Keras.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, Protocol

from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh

__all__ = [
    "LayerKind", "Pending", "ModuleBackend", "register_module_backend", "module_backend", "loaded_backends",
    "replicate_unplaced", "with_hooks",
]

# framework package -> the module that registers tfdist's backend for it
_PLUGINS = {"keras": "tfdist.keras._modules"}
_BACKENDS: dict[str, "ModuleBackend"] = {}


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What the tensor-parallel styles need to know of a layer, framework-free.

    ``kind`` is one of ``"dense"``, ``"einsum"``, ``"embedding"``, ``"norm"``,
    ``"dropout"``, ``"attention"`` or ``"other"``.  ``equation`` and
    ``bias_axes`` describe an einsum layer; ``num_embeddings`` an embedding.
    A dense or einsum layer computes ``activation(einsum(equation_for(rank),
    x, kernel) + bias)`` in ``compute_dtype`` (its weights ``"kernel"`` and
    ``"bias"``); ``extended_by`` names what the layer adds to that formula
    (``"lora_enabled=True"``, a quantization mode), and then nothing may
    compute the product in its place (``plain`` is False).

    Example::

        kind = modules.layer_kind(dense)        # LayerKind("dense", ...)
        kind.equation_for(3)                    # "abk,kn->abn"
        inp, ker, out = kind.einsum_parts(3)    # "abk", "kn", "abn"
    """

    kind: str
    use_bias: bool = True
    equation: str = ""
    bias_axes: str = ""
    num_embeddings: int = 0
    extended_by: str = ""
    activation: Callable[[Any], Any] | None = None
    compute_dtype: str | None = None

    @property
    def plain(self) -> bool:
        return not self.extended_by

    def equation_for(self, rank: int) -> str:
        """The einsum of the layer's product for an input of ``rank`` dims (a dense layer contracts
        the last input dim ``k`` with the kernel's first)."""
        if self.kind == "dense":
            lead = "abcdefghijlmopqrsuvwxy"[: rank - 1]
            return f"{lead}k,kn->{lead}n"
        if self.kind == "einsum":
            return self.equation
        raise ValueError(f"a {self.kind!r} layer is not an einsum product")

    def einsum_parts(self, rank: int = 2) -> tuple[str, str, str]:
        """(input, kernel, output) subscripts of ``equation_for(rank)``."""
        lhs, out = self.equation_for(rank).split("->")
        inp, ker = lhs.split(",")
        return inp, ker, out


class Pending:
    """A sublayer its parent creates only when it builds (e.g. attention projections)."""

    def __init__(self, parent: Any, attr: str) -> None:
        self.parent, self.attr = parent, attr


class ModuleBackend(Protocol):
    """What ``tfdist.tensor`` asks of a model framework."""

    name: str

    def named_layers(self, module: Any) -> Iterator[tuple[str, Any]]:
        """(torch-style FQN, layer or Pending) for the module and every sublayer."""

    def layer_name(self, layer: Any) -> str: ...

    def is_built(self, layer: Any) -> bool: ...

    def layer_kind(self, layer: Any) -> LayerKind: ...

    def weights(self, layer: Any) -> dict[str, Any]:
        """Name (``"kernel"``) -> variable of a built layer's own weights."""

    def variables(self, module: Any) -> list[Any]:
        """Every variable of the module and its sublayers."""

    def all_weights(self, module: Any) -> list[Any]:
        """The weights of the module and all its sublayers (no random-generator state, no metrics)."""

    def frozen_weights(self, module: Any) -> list[Any]:
        """The weights of frozen sublayers (torch's parameters with ``requires_grad=False``)."""

    def optimizer_scalars(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's own state variables a checkpoint keeps beside its slots: the step count
        (``"iterations"``) and, where it is a variable, ``"learning_rate"``."""

    def set_weight_layout(self, layer: Any, name: str, layout_fn: Callable[[int], dtensor.Layout]) -> None:
        """Lays out a weight now (built) or when it is created (unbuilt)."""

    def batch_norm_classes(self) -> tuple[type, ...]:
        """The framework's batch-norm layer classes (torch's ``_BatchNorm``: FSDP1's
        ``MixedPrecision`` keeps them in full precision by default)."""

    def is_trainable(self, variable: Any) -> bool:
        """True for a weight the optimizer updates (FSDP shards only those)."""

    def check_layout(self, variable: Any, layout: dtensor.Layout) -> None:
        """Raises ValueError when ``variable`` cannot take ``layout``."""

    def place_variable(self, variable: Any, layout: dtensor.Layout) -> None:
        """Moves a variable onto ``layout`` in place."""

    def offload_variable(self, variable: Any, layout: dtensor.Layout) -> None:
        """Stores a variable placed on ``layout`` on the host mesh with the same sharding (CPU
        offload, ``tfdist.fsdp._offload``); its steps run on a copy laid out by ``layout``."""

    def device_copies_for_call(self, variables: list[Any], what: str) -> AbstractContextManager:
        """Within it, offloaded ``variables`` read as device copies (made for an eager call of
        ``what``; a traced call outside the framework's steps is refused)."""

    def is_placed(self, variable: Any) -> bool:
        """True when the variable already lives on a mesh."""

    def new_variable(self, value: Any, layout: dtensor.Layout, name: str, trainable: bool) -> Any:
        """A new variable of the framework (not owned by a layer) holding ``value`` on ``layout``."""

    def variable_layout(self, variable: Any) -> dtensor.Layout | None:
        """The layout of a variable on a mesh (None when it is not on one)."""

    def stored_value(self, variable: Any) -> Any:
        """The variable's stored tensor: its own dtype and layout (no autocast, no ``read_as``)."""

    def read_as(self, values: list[tuple[Any, Any]]) -> AbstractContextManager:
        """Within it (this thread), reading a variable of the ``(variable, tensor)`` pairs gives its tensor."""

    def call_replaced(self, layer: Any) -> bool:
        """True when a style already replaced the layer's computation (``replace_call``)."""

    def defer(self, pending: Pending, apply: Callable[[Any], None]) -> None:
        """Runs ``apply(sublayer)`` once ``pending`` exists."""

    def wrap_call(self, layer: Any, before: Callable | None, after: Callable | None) -> None:
        """``before(args, kwargs) -> (args, kwargs)`` and ``after(outputs)`` around each call."""

    def replace_call(self, layer: Any, call: Callable[..., Any]) -> None:
        """Calls go to ``call(original_call, *args, **kwargs)``."""

    def replace_inner_call(self, layer: Any, call: Callable[..., Any]) -> None:
        """Like ``replace_call`` but inside the hooks already around the call (``wrap_call``)."""

    def is_symbolic(self, x: Any) -> bool:
        """True for a symbolic placeholder (a functional model's build-time input)."""

    def attach_mesh(self, module: Any, mesh: DeviceMesh, batch_axis: int | None) -> None:
        """Makes variables created later (optimizer slots, metrics) live on ``mesh``."""

    def sharded_loss_scope(self, cross_entropy: Callable[..., Any]) -> AbstractContextManager:
        """Within it (this thread), the framework's sparse cross-entropy calls ``cross_entropy``."""

    def attention_scope(self, relayout_qkv: Callable[[Any, Any, Any], tuple]) -> AbstractContextManager:
        """Within it (this thread), attention layers relayout query/key/value first."""


def with_hooks(call: Callable[..., Any], before: Callable | None, after: Callable | None) -> Callable[..., Any]:
    """``call`` with ``before(args, kwargs) -> (args, kwargs)`` and ``after(outputs)`` around it: what a
    backend's ``wrap_call`` puts on a layer."""

    @functools.wraps(call)
    def wrapped(*args, **kwargs):
        if before is not None:
            args, kwargs = before(args, kwargs)
        outputs = call(*args, **kwargs)
        return after(outputs) if after is not None else outputs

    return wrapped


def register_module_backend(package: str, backend: ModuleBackend) -> None:
    """Registers ``backend`` for objects whose class comes from ``package``."""
    _BACKENDS[package] = backend


def module_backend(module: Any, api: str) -> ModuleBackend:
    """The backend that serves ``module`` (loading tfdist's plug-in for its framework).

    Raises:
        TypeError: no backend handles objects of this type.
    """
    for cls in type(module).__mro__:
        package = cls.__module__.split(".")[0]
        if package in _BACKENDS:
            return _BACKENDS[package]
        if package in _PLUGINS:
            importlib.import_module(_PLUGINS[package])  # registers itself
            return _BACKENDS[package]
    raise TypeError(
        f"{api} works on Keras 3 layers and models. Received: module of type "
        f"{type(module).__module__}.{type(module).__name__}"
    )


def replicate_unplaced(modules: ModuleBackend, module: Any, mesh: DeviceMesh) -> None:
    """Puts every variable of ``module`` not yet on a mesh onto ``mesh``'s root, replicated."""
    tf_mesh = mesh.root_mesh.to_tf()
    for variable in modules.variables(module):
        if not modules.is_placed(variable):
            modules.place_variable(variable, dtensor.Layout.replicated(tf_mesh, len(variable.shape)))


def loaded_backends() -> list[ModuleBackend]:
    """Backends of the frameworks this process has imported (loading tfdist's plug-ins)."""
    for package, plugin in _PLUGINS.items():
        if package in sys.modules and package not in _BACKENDS:
            importlib.import_module(plugin)
    return list(_BACKENDS.values())
