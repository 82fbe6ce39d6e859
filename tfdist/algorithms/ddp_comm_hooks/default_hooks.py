"""DDP's default communication hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks).

Each returns, for every replica, the mean of the replicas' gradients (one
all-reduce, torch's bytes); the compressing hooks reduce in float16 /
bfloat16 (half the bytes) and cast back.  ``process_group`` must be None:
every replica of the module's mesh.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.algorithms.model_averaging.utils import _check_group
from tfdist.nn.parallel._grad_bucket import GradBucket
from tfdist.nn.parallel._replicas import replica_mean

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


def allreduce_hook(process_group: Any, bucket: GradBucket) -> tf.Tensor:
    """The replicas' mean gradient (what DDP does without a hook).

    Example::

        model.register_comm_hook(None, allreduce_hook)
    """
    _check_group(process_group)
    return replica_mean(bucket.buffer(), bucket.mesh, bucket.dp)[1]


def fp16_compress_hook(process_group: Any, bucket: GradBucket) -> tf.Tensor:
    """The mean gradient, reduced in float16."""
    _check_group(process_group)
    return replica_mean(bucket.buffer(), bucket.mesh, bucket.dp, dtype=tf.float16)[1]


def bf16_compress_hook(process_group: Any, bucket: GradBucket) -> tf.Tensor:
    """The mean gradient, reduced in bfloat16."""
    _check_group(process_group)
    return replica_mean(bucket.buffer(), bucket.mesh, bucket.dp, dtype=tf.bfloat16)[1]
