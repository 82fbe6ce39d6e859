"""PostLocalSGDOptimizer (torch.distributed.optim.PostLocalSGDOptimizer): not expressible on TF DTensor.

Local SGD lets each data-parallel replica take steps on its own copy of the
parameters and averages the copies every ``period`` steps.  A TF DTensor
variable has one global value: a replicated layout means every device holds
*the same* value, and TF computes with that assumption -- ``dtensor.pack``
accepts different per-device values under a replicated layout, but any op on
the result reads one of them (``tf.reduce_sum`` of 8 "replicated" copies
0..7 returns 0.0).  And the gradient of a batch-sharded loss with respect to
a replicated variable is summed over the batch shards inside the op (an
all-reduce), so no replica ever sees its local gradient.  Per-device copies
would need per-device unpack/pack on every step, which tfdist does not do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PostLocalSGDOptimizer"]

_WHY = (
    "PostLocalSGDOptimizer needs each data-parallel replica to keep its own, diverging copy of the "
    "parameters. A TF DTensor variable has one global value (a replicated layout means identical copies, "
    "and the gradient of a batch-sharded loss is all-reduced inside the op), so local SGD cannot be "
    "expressed. Use synchronous data parallel (keras.distribution.DataParallel), fully_shard, or "
    "ZeroRedundancyOptimizer."
)


class PostLocalSGDOptimizer:
    """Raises ``NotImplementedError``: see the module docstring for why TF DTensor cannot do local SGD."""

    def __init__(self, optim: Any = None, averager: Any = None) -> None:
        raise NotImplementedError(_WHY)
