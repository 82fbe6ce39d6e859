"""tfdist's record of the objects it distributes: one typed state per object, kept here.

tfdist never writes attributes of its own onto Keras or TensorFlow objects
(layers, models, variables, optimizers): what one package decides about a
module (its mesh and distribution, its batch dim, its FSDP
state, the layouts its weights get) and another package reads later lives
in a record here, keyed by the object's identity and dropped when the object
is collected.  Objects tfdist owns keep their own fields.

Example::

    from tfdist import _registry
    _registry.module(model).batch_dim = "batch"       # keras/_modules.py
    state = _registry.module_if_any(model)            # keras/_trainer.py
    batch = state.batch_dim if state is not None else None
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Generic, TypeVar


@dataclasses.dataclass
class ModuleState:
    """What tfdist knows of one distributed module (a Keras layer or model, or a backend's module)."""

    distribution: Any = None  # the module's own keras distribution (keras/_modules._own_distribution)
    batch_dim: str | None = None  # the mesh dim its batch is split over
    scoped_methods: set[str] = dataclasses.field(default_factory=set)  # methods run under `distribution`
    base_call: Callable[..., Any] | None = None  # the innermost call under tfdist's hooks
    call_replaced: bool = False  # a parallel style replaced its computation
    weight_layouts: dict[str, Callable[[int], Any]] = dataclasses.field(default_factory=dict)  # before build
    fsdp: Any = None  # fully_shard's _FSDPState
    fsdp_style: Any = None  # the FSDPStyle gathering this layer's weights where used
    ddp: Any = None  # DistributedDataParallel's replicas and comm hook
    fsdp1_root: bool = False  # FullyShardedDataParallel: the root unit
    state_dict_settings: Any = None  # FSDP1 state_dict_type settings of this unit


@dataclasses.dataclass
class VariableState:
    """What tfdist knows of one variable."""

    layout_fn: Callable[[int], Any] | None = None  # created before its values exist: its layout then
    logical_shape: tuple[int, ...] | None = None  # a DVariable stored padded: the shape Keras sees
    replicas_of: Any = None  # DistributedDataParallel's stacked replicas [R, ...] of this module variable
    device_layout: Any = None  # CPU offload: stored on the host mesh; the layout of its per-step device copy
    laid_out_by: Any = None  # the keras distribution whose layout the variable was created with


@dataclasses.dataclass
class OptimizerState:
    """An optimizer whose slots are laid out unlike their variables (ZeroRedundancyOptimizer)."""

    slot_layout: Callable[..., Any] | None = None
    averager: Any = None  # PostLocalSGDOptimizer's model averager
    params: Any = None  # the variables ZeroRedundancyOptimizer was given (what its step() updates)


S = TypeVar("S")


class _Registry(Generic[S]):
    """Identity-keyed weak mapping: works for objects that are unhashable or define ``==`` as an op
    (``tf.Variable``), and drops an entry when its object is collected."""

    def __init__(self, factory: Callable[[], S]):
        self._factory = factory
        self._entries: dict[int, tuple[weakref.ref, S]] = {}
        self._lock = threading.Lock()

    def get(self, obj: Any) -> S | None:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def of(self, obj: Any) -> S:
        state = self.get(obj)
        if state is not None:
            return state
        with self._lock:
            state = self.get(obj)
            if state is None:
                key = id(obj)
                ref = weakref.ref(obj, lambda _, key=key: self._drop(key))
                state = self._factory()
                self._entries[key] = (ref, state)
        return state

    def _drop(self, key: int) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is None:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


_MODULES: _Registry[ModuleState] = _Registry(ModuleState)
_VARIABLES: _Registry[VariableState] = _Registry(VariableState)
_OPTIMIZERS: _Registry[OptimizerState] = _Registry(OptimizerState)


def module(obj: Any) -> ModuleState:
    """``obj``'s state, created empty the first time."""
    return _MODULES.of(obj)


def module_if_any(obj: Any) -> ModuleState | None:
    """``obj``'s state if tfdist has recorded any (reading never creates one)."""
    return _MODULES.get(obj)


def variable(obj: Any) -> VariableState:
    return _VARIABLES.of(obj)


def variable_if_any(obj: Any) -> VariableState | None:
    return _VARIABLES.get(obj)


def optimizer(obj: Any) -> OptimizerState:
    return _OPTIMIZERS.of(obj)


def optimizer_if_any(obj: Any) -> OptimizerState | None:
    return _OPTIMIZERS.get(obj)


def distribution_of(obj: Any) -> Any:
    """The distribution tfdist gave ``obj`` (None if it has none of its own)."""
    state = _MODULES.get(obj)
    return state.distribution if state is not None else None


_SWAPPED: dict[str, str] = {}  # the name of a class tfdist made for a module -> the class it extends


def swapped_class(name: str, bases: tuple[type, ...], original: type) -> type:
    """A class ``name`` deriving ``bases`` that tfdist gives an object of class ``original``
    (torch's names: ``FSDPDense``, ``DistributedDataParallelGPT``); recorded, so that a framework
    that files objects by class name (Keras' weights files) can file it as ``original``.

    Example::

        cls = swapped_class(f"FSDP{type(layer).__name__}", (type(layer), FSDPModule), type(layer))
    """
    cls = type(name, bases, {"__module__": original.__module__})
    _SWAPPED[cls.__name__] = original.__name__
    return cls


def original_class_name(name: str, spelling: Callable[[str], str] = str) -> str:
    """``name`` if no swapped class is called that (as ``spelling`` writes class names), else the
    name of the class tfdist's swapped class extends, in the same spelling."""
    for new, original in _SWAPPED.items():
        if spelling(new) == name:
            return original_class_name(spelling(original), spelling)
    return name

