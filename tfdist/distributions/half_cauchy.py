"""HalfCauchy with torch's parameterisation (torch.distributions.half_cauchy)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["HalfCauchy"]


_HalfCauchy = _one("HalfCauchy", "scale", lambda s: tfd().HalfCauchy(loc=tf.zeros_like(s), scale=s),
                  constraints.nonnegative)


class HalfCauchy(_HalfCauchy):
    __doc__ = _HalfCauchy.__doc__

    @property
    def mean(self):
        """Infinite (the integral diverges), as torch."""
        return tf.zeros_like(self.scale) + float("inf")

    @property
    def variance(self):
        return tf.zeros_like(self.scale) + float("inf")

    def icdf(self, prob):
        """The value below which the distribution puts probability ``prob`` (torch names it ``prob``)."""
        return super().icdf(prob)
