"""Tensor parallelism for Keras 3 layers (torch.distributed.tensor.parallel).

The styles speak placements; Keras layers are reached through
``tfdist.tensor._modules`` (tfdist.keras is loaded when the first Keras
layer is parallelized).
"""

from tfdist.tensor.parallel.api import parallelize_module
from tfdist.tensor.parallel.loss import loss_parallel
from tfdist.tensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "parallelize_module",
    "loss_parallel",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
]
