"""Tensor parallelism for Keras 3 layers (torch.distributed.tensor.parallel).

Importing it imports Keras (and installs tfdist's Keras integration).
"""

import tfdist.keras  # noqa: F401  (variables, optimizer and fit on DTensor)
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
