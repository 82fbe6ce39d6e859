"""Independent with torch's parameterisation (torch.distributions.independent)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.utils import as_shape

__all__ = ["Independent"]


class Independent(Distribution):
    """Independent(base_distribution, reinterpreted_batch_ndims): batch dims become event dims."""

    arg_constraints: dict = {}

    def __init__(self, base_distribution, reinterpreted_batch_ndims, validate_args=None):
        batch = base_distribution.batch_shape
        if not 0 <= reinterpreted_batch_ndims <= len(batch):
            raise ValueError(
                "Expected reinterpreted_batch_ndims <= len(base_distribution.batch_shape), "
                f"actual {reinterpreted_batch_ndims} vs {len(batch)}"
            )
        self.base_dist = base_distribution
        self.reinterpreted_batch_ndims = reinterpreted_batch_ndims
        cut = len(batch) - reinterpreted_batch_ndims
        super().__init__(batch[:cut], batch[cut:].concatenate(base_distribution.event_shape), validate_args)

    @property
    def has_rsample(self):
        return self.base_dist.has_rsample

    @property
    def has_enumerate_support(self):
        return False if self.reinterpreted_batch_ndims else self.base_dist.has_enumerate_support

    @property
    def support(self):
        s = self.base_dist.support
        return constraints.independent(s, self.reinterpreted_batch_ndims) if self.reinterpreted_batch_ndims else s

    def _reduce(self, value):
        n = self.reinterpreted_batch_ndims
        return tf.reduce_sum(value, axis=list(range(-n, 0))) if n else value

    def rsample(self, sample_shape=()):
        return self.base_dist.rsample(sample_shape)

    def sample(self, sample_shape=()):
        return self.base_dist.sample(sample_shape)

    def log_prob(self, value):
        return self._reduce(self.base_dist.log_prob(value))

    def entropy(self):
        return self._reduce(self.base_dist.entropy())

    @property
    def mean(self):
        return self.base_dist.mean

    @property
    def mode(self):
        return self.base_dist.mode

    @property
    def variance(self):
        return self.base_dist.variance

    def enumerate_support(self, expand=True):
        if self.reinterpreted_batch_ndims > 0:
            raise NotImplementedError("Enumeration over cartesian product is not implemented")
        return self.base_dist.enumerate_support(expand=expand)

    def expand(self, batch_shape, _instance=None):
        batch_shape = as_shape(batch_shape)
        base = self.base_dist.expand(batch_shape.concatenate(self.event_shape[: self.reinterpreted_batch_ndims]))
        return Independent(base, self.reinterpreted_batch_ndims)
