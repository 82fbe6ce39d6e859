"""TransformedDistribution: a base distribution pushed through transforms."""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.transforms import ComposeTransform, Transform
from tfdist.distributions.utils import _sum_rightmost, as_shape

__all__ = ["TransformedDistribution"]



class TransformedDistribution(Distribution):
    """``base_distribution`` followed by ``transforms`` (a Transform or a list).

    ``log_prob(y) = base.log_prob(x) - sum log|det J|`` with ``x`` the inverse
    image of ``y``.

    Example::

        log_normal = TransformedDistribution(Normal(0.0, 1.0), [ExpTransform()])
    """

    arg_constraints: dict = {}

    def __init__(self, base_distribution: Distribution, transforms: Transform | Sequence[Transform],
                 validate_args=None) -> None:
        if isinstance(transforms, Transform):
            transforms = [transforms]
        transforms = list(transforms)
        if not all(isinstance(t, Transform) for t in transforms):
            raise ValueError(f"transforms must be a Transform or a list of Transforms, but was {transforms}")
        self.base_dist = base_distribution
        self.transforms = transforms
        chain = ComposeTransform(transforms)
        shape = tuple(base_distribution.batch_shape.concatenate(base_distribution.event_shape).as_list())
        shape = chain.forward_shape(shape) if transforms else shape
        event_dim = max(chain.codomain.event_dim if transforms else 0, len(base_distribution.event_shape))
        cut = len(shape) - event_dim
        super().__init__(shape[:cut], shape[cut:], validate_args)

    @property
    def has_rsample(self):
        return self.base_dist.has_rsample

    @property
    def support(self):
        if not self.transforms:
            return self.base_dist.support
        support = self.transforms[-1].codomain
        extra = len(self.event_shape) - support.event_dim
        return constraints.independent(support, extra) if extra > 0 else support

    def sample(self, sample_shape=()):
        x = self.base_dist.sample(sample_shape)
        for t in self.transforms:
            x = t(x)
        return x

    def rsample(self, sample_shape=()):
        x = self.base_dist.rsample(sample_shape)
        for t in self.transforms:
            x = t(x)
        return x

    def log_prob(self, value):
        self._validate_sample(value)
        event_dim = len(self.event_shape)
        log_prob = 0.0
        y = tf.convert_to_tensor(value)
        for t in reversed(self.transforms):
            x = t.inv(y)
            event_dim += t.domain.event_dim - t.codomain.event_dim
            log_prob = log_prob - _sum_rightmost(t.log_abs_det_jacobian(x, y), event_dim - t.domain.event_dim)
            y = x
        base_event = len(self.base_dist.event_shape)
        return log_prob + _sum_rightmost(self.base_dist.log_prob(y), event_dim - base_event)

    def _monotone(self, value, fn):
        sign = 1
        for t in self.transforms:
            sign = sign * t.sign
        x = tf.convert_to_tensor(value)
        for t in reversed(self.transforms):
            x = t.inv(x)
        out = fn(x)
        return out if (isinstance(sign, int) and sign == 1) else tf.where(tf.cast(sign, out.dtype) > 0, out, 1 - out)

    def cdf(self, value):
        return self._monotone(value, self.base_dist.cdf)

    def icdf(self, value):
        x = self.base_dist.icdf(value)
        for t in self.transforms:
            x = t(x)
        return x

    def expand(self, batch_shape, _instance=None):
        base = self.base_dist.expand(as_shape(batch_shape))
        return TransformedDistribution(base, self.transforms)
