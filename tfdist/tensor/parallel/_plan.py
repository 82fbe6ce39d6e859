"""Matching a tensor-parallel plan (layer-path patterns -> styles) against a module."""

from __future__ import annotations

import re
from typing import Any

from tfdist.tensor._modules import ModuleBackend

__all__ = ["match_plan"]


def _pattern(key: str) -> re.Pattern:
    """torch-style path pattern: ``*`` is one path segment (or part of one), ``**`` any."""
    parts = [
        ".*" if p == "**" else "[^.]*" if p == "*" else re.escape(p).replace(r"\*", "[^.]*")
        for p in key.split(".")
    ]
    return re.compile(r"\.".join(parts))


def match_plan(modules: ModuleBackend, root: Any, plan: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(fqn, layer, style) for every plan key; unmatched keys and double matches are errors."""
    layers = [(fqn, layer) for fqn, layer in modules.named_layers(root) if fqn]
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
