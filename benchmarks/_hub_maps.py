"""A layout map in the pattern of keras-hub's ``LlamaBackbone.get_layout_map`` for any keras-hub
backbone (shared by benchmarks/keras_hub_vs_jax.py and the layout-map zoo test)."""

from __future__ import annotations

import re
from typing import Any


def llama_pattern_map(keras: Any, backbone: Any, mesh: Any, hidden: int, vocab: int) -> Any:
    """From the variables' paths and shapes: token embeddings ``(model, batch)``, q/k/v kernels
    ``(model, batch, None)``, attention output ``(model, None, batch)``, dense kernels widening
    the hidden dim ``(batch, model)``, those narrowing it ``(model, batch)``; convolution
    kernels' output channels over ``model``.  A weight shared by several layers is mapped once."""
    layout_map = keras.distribution.LayoutMap(mesh)
    for v in {w.path: w for w in reversed(backbone.weights)}.values():
        path, shape, key = v.path, tuple(v.shape), "^" + re.escape(v.path) + "$"
        if len(shape) == 2 and "embedding" in path and "position" not in path and shape[0] == vocab:
            layout_map[key] = ("model", "batch")
        elif len(shape) == 3 and shape[0] == hidden:
            layout_map[key] = ("model", "batch", None)
        elif len(shape) == 3 and shape[-1] == hidden:
            layout_map[key] = ("model", None, "batch")
        elif len(shape) == 2 and shape[0] == hidden and shape[1] > hidden:
            layout_map[key] = ("batch", "model")
        elif len(shape) == 2 and shape[1] == hidden and shape[0] > hidden:
            layout_map[key] = ("model", "batch")
        elif len(shape) == 4:  # a convolution's kernel: output channels over model
            layout_map[key] = (None, None, None, "model")
    return layout_map
