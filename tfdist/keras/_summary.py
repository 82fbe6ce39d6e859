"""summary: every variable of a Keras model with its placements and bytes per device."""

from __future__ import annotations

import math
from typing import Any, Callable

import keras
import tensorflow as tf

from tfdist.keras import _variables
from tfdist.tensor._layout import placements_from_tf_layout

__all__ = ["summary"]


def _row(variable: Any) -> tuple[str, str, str, int]:
    """(path, shape, placements, bytes this device holds) of one Keras variable."""
    shape = tuple(int(n) for n in variable.shape)
    itemsize = tf.as_dtype(keras.backend.standardize_dtype(variable.dtype)).size
    if not _variables.is_dtensor_variable(variable):
        return variable.path, str(shape), "(not on a mesh)", math.prod(shape) * itemsize
    layout = _variables.layout_of(variable._value)
    mesh = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
    local = [n // mesh[s] if s in mesh else n for n, s in zip(shape, layout.sharding_specs)]
    placements = placements_from_tf_layout(layout)
    names = ", ".join(f"{name}: {p}" for name, p in zip(layout.mesh.dim_names, placements))
    return variable.path, str(shape), names, math.prod(local) * itemsize


def summary(model: Any, print_fn: Callable[[str], Any] = print) -> str:
    """Prints (and returns) the model's variables: path, shape, placements, bytes per device.

    Example::

        parallelize_gpt(model, mesh)
        tfdist.keras.summary(model)
        # path                        shape      placements        bytes/device
        # gpt/block/mlp/dense/kernel  (32, 128)  dp: R, tp: S(1)   4,096
    """
    rows = [_row(v) for v in model.variables]
    table = [("path", "shape", "placements", "bytes/device")] + [(p, s, pl, f"{b:,}") for p, s, pl, b in rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.append(f"total bytes per device: {sum(r[3] for r in rows):,}")
    text = "\n".join(lines)
    print_fn(text)
    return text
