"""FSDP policies (torch.distributed.fsdp.MixedPrecisionPolicy / OffloadPolicy / CPUOffloadPolicy)."""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


def _float_dtype(name: str, value: Any) -> tf.DType | None:
    if value is None:
        return None
    try:
        dtype = tf.as_dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not dtype.is_floating:
        raise ValueError(
            f"MixedPrecisionPolicy({name}=...) must be a floating dtype such as 'bfloat16', "
            f"'float16' or 'float32' (or None). Received: {name}={value!r}"
        )
    return dtype


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision for ``fully_shard``.

    ``param_dtype``: the dtype parameters are all-gathered in and computed
    with (the sharded parameters, which the optimizer updates, keep their own
    dtype).  ``reduce_dtype``: the dtype gradients are reduce-scattered in
    (None: ``param_dtype``).  ``output_dtype``: floating outputs of the
    module are cast to it.  ``cast_forward_inputs``: floating inputs are cast
    to ``param_dtype``.  Dtypes are TF dtypes or their names.

    Example::

        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype="bfloat16",
                                                          reduce_dtype="float32"))
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, name, _float_dtype(name, getattr(self, name)))
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"MixedPrecisionPolicy(cast_forward_inputs=...) must be a bool. Received: {self.cast_forward_inputs!r}"
            )


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the devices."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer state in host memory (torch's CPU offload).

    Between steps the shards live on the device mesh's host mesh; ``fit`` /
    ``evaluate`` / ``predict`` copy each device's shard in for the step and the
    gradient shards back, and the optimizer step runs on the host mesh
    (docs/fsdp.md, "CPU offload").  ``pin_memory`` is accepted for torch
    compatibility; TensorFlow manages host staging buffers itself.

    Example::

        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        model.compile(optimizer="adam", loss="mse"); model.fit(x, y, batch_size=64)
    """

    pin_memory: bool = True
