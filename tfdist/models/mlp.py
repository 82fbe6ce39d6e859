"""MLP: two Dense layers, and its Megatron tensor-parallel plan."""

from __future__ import annotations

from typing import Any

import keras

from tfdist.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["MLP", "mlp_tp_plan"]


class MLP(keras.Model):
    """``up`` (Dense, gelu) then ``down`` (Dense)."""

    def __init__(self, dim: int, hidden: int, out: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(hidden, activation="gelu")
        self.down = keras.layers.Dense(out or dim)

    def call(self, x):
        return self.down(self.up(x))


def mlp_tp_plan(prefix: str = "") -> dict[str, ParallelStyle]:
    """Megatron MLP: column-parallel up, row-parallel down (one all-reduce)."""
    return {f"{prefix}up": ColwiseParallel(), f"{prefix}down": RowwiseParallel()}
