"""CommDebugMode's module view: which layer each collective of an executed program belongs to.

torch's CommDebugMode learns the module hierarchy from module hooks while the
code runs.  A TF step runs as one compiled program, so there is nothing to hook;
instead each collective node of the SPMD-expanded program keeps the name scope
of the op that needed it (``gpt_1/block_1/mlp_1/dense_1_2/Tensordot/MatMul/
DTensorAllReduceOp_...``; ``gradient_tape/...`` in the backward), and Keras
opens one name scope per layer call.  The scope is walked down the layer tree
of the live model whose name starts it, matching each segment to a child's
name (TF appends ``_<n>`` to a scope used twice in one graph); the first
segment that names no child ends the walk.  Module names follow torch's
ModuleTracker: the root is its class name, below it the torch FQN
(``GPT.blocks.0.mlp.up``).  A collective outside any known layer (the loss,
an eager redistribute) belongs to ``Global`` only; every module's counts
include its children's, and ``Global`` holds them all, as in torch.

Live models are found once per report by a scan of the garbage collector's
objects (debug output, never a training step), through the module backends
tfdist has for the frameworks the process imported.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import re
from typing import Any

from tfdist.tensor import _modules
from tfdist.tensor._layout import placements_from_tf_layout

GLOBAL = "Global"
_SUFFIX = re.compile(r"_\d+$")


@dataclasses.dataclass
class ModuleInfo:
    """One module of the report: its type, its parameters' placements, its children."""

    fqn: str
    depth: int
    module_type: str = ""
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> placements
    children: list[str] = dataclasses.field(default_factory=list)


def _names_match(segment: str, name: str) -> bool:
    return segment == name or _SUFFIX.sub("", segment) == name


def _backend_of(cls: type, cache: dict[type, Any]) -> Any:
    """The module backend serving instances of ``cls`` (looked up once per class), or None."""
    if cls not in cache:
        packages = [c.__dict__.get("__module__") for c in cls.__mro__]  # a slot may shadow __module__
        packages = [p.split(".")[0] for p in packages if isinstance(p, str)]
        cache[cls] = next((_modules._BACKENDS[p] for p in packages if p in _modules._BACKENDS), None)
    return cache[cls]


def _live_roots(first_segments: set[str]) -> list[tuple[Any, Any]]:
    """(backend, root module) for the live modules whose name starts one of the scopes."""
    if not first_segments:
        return []
    _modules.loaded_backends()
    cache: dict[type, Any] = {}
    found = []
    for obj in gc.get_objects():
        backend = _backend_of(type(obj), cache)
        if backend is None:
            continue
        try:
            name = backend.layer_name(obj)
        except Exception:  # noqa: BLE001 - an object of the framework that is not a layer
            continue
        if isinstance(name, str) and any(_names_match(s, name) for s in first_segments):
            found.append((backend, obj))
    # a model nested in another found one is reached through its parent
    nested = set()
    for backend, root in found:
        try:
            nested |= {id(layer) for fqn, layer in backend.named_layers(root) if fqn}
        except (AttributeError, TypeError):
            continue
    roots = [(b, r) for b, r in found if id(r) not in nested]
    # several live models may share a name: the ones with weights on a mesh are the distributed ones
    return sorted(roots, key=lambda br: not _on_a_mesh(*br))


def _on_a_mesh(backend: Any, module: Any) -> bool:
    try:
        return any(backend.variable_layout(v) is not None for v in backend.variables(module))
    except (AttributeError, TypeError):
        return False


class ModuleTree:
    """The layer trees of the live models the collectives' scopes name."""

    def __init__(self, scopes: set[tuple[str, ...]]) -> None:
        self.modules: dict[str, ModuleInfo] = {GLOBAL: ModuleInfo(GLOBAL, 0)}
        self._roots: list[tuple[str, Any, dict[str, list[tuple[str, Any]]]]] = []
        for backend, root in _live_roots({s[0] for s in scopes if s}):
            try:
                layers = [(fqn, layer, backend.weights(layer)) for fqn, layer in backend.named_layers(root)]
            except (AttributeError, TypeError):  # an object of the framework named like a scope, not a model
                continue
            children: dict[str, list[tuple[str, Any]]] = collections.defaultdict(list)
            prefix = type(root).__name__
            for fqn, layer, weights in layers:
                full = f"{prefix}.{fqn}" if fqn else prefix
                parent = full.rsplit(".", 1)[0] if fqn else GLOBAL
                while parent not in self.modules:  # "blocks.0": its parent is the model, not the list
                    parent = parent.rsplit(".", 1)[0]
                children[parent].append((full, layer))
                self._add_module(backend, full, layer, parent, weights)
            self._roots.append((backend.layer_name(root), backend, children))

    def _add_module(self, backend: Any, fqn: str, layer: Any, parent: str, weights: dict[str, Any]) -> None:
        info = ModuleInfo(fqn, self.modules[parent].depth + 1, type(layer).__name__)
        for name, variable in weights.items():
            layout = backend.variable_layout(variable)
            if layout is not None:
                info.parameters[name] = placements_from_tf_layout(layout)
        self.modules[fqn] = info
        self.modules[parent].children.append(fqn)

    def add_marked(self, name: str) -> str:
        """A module named with ``CommDebugMode.module(name)``: a child of ``Global``."""
        if name not in self.modules:
            self.modules[name] = ModuleInfo(name, 1)
            self.modules[GLOBAL].children.append(name)
        return name

    def resolve(self, segments: tuple[str, ...]) -> list[str]:
        """The modules a collective with this scope belongs to, outermost first (``Global`` first)."""
        path = [GLOBAL]
        if not segments:
            return path
        for root_name, backend, children in self._roots:
            if not _names_match(segments[0], root_name):
                continue
            current = next(fqn for fqn, _ in children[GLOBAL])
            path.append(current)
            for segment in segments[1:]:
                match = next((fqn for fqn, layer in children[current]
                              if _names_match(segment, backend.layer_name(layer))), None)
                if match is None:
                    break
                path.append(match)
                current = match
            return path
        return path

    def called(self, counted: set[str]) -> list[str]:
        """Modules in tree order (depth first), keeping those with collectives and their ancestors,
        and every module of a root that ran any."""
        order: list[str] = []

        def visit(fqn: str) -> None:
            order.append(fqn)
            for child in self.modules[fqn].children:
                visit(child)

        visit(GLOBAL)
        roots = {fqn for fqn in self.modules[GLOBAL].children if fqn in counted}
        return [m for m in order if m == GLOBAL or m in roots or self._root_of(m) in roots]

    def _root_of(self, fqn: str) -> str:
        return fqn.split(".")[0]
