"""Uniform with torch's parameterisation (torch.distributions.uniform)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _Support
from tfdist.distributions._tfp_backed import _TFPBacked, tfd
from tfdist.distributions.utils import broadcast_all

__all__ = ["Uniform"]


class Uniform(_TFPBacked):
    """Uniform(low, high): [low, high)."""

    arg_constraints = {"low": constraints.dependent, "high": constraints.dependent}
    has_rsample = True
    _params = ("low", "high")
    support = _Support(lambda self: constraints.interval(self.low, self.high))  # torch's object

    def __init__(self, low, high, validate_args=None):
        self.low, self.high = broadcast_all(low, high)
        super().__init__(self.low.shape, (), validate_args)
        if self._validate_args and tf.executing_eagerly() and not bool(tf.reduce_all(self.low < self.high)):
            raise ValueError("Expected parameter low to be less than high in Uniform.")

    def _tfp(self):
        return tfd().Uniform(self.low, self.high)

    # torch's formulas, so that values outside [low, high) and for low >= high (validate_args=False) are torch's
    def log_prob(self, value):
        self._validate_sample(value)
        value = tf.cast(value, self._dtype)
        inside = tf.cast(tf.logical_and(self.low <= value, self.high > value), self._dtype)
        return tf.math.log(inside) - tf.math.log(self.high - self.low)

    def cdf(self, value):
        self._validate_sample(value)
        return tf.clip_by_value((tf.cast(value, self._dtype) - self.low) / (self.high - self.low), 0.0, 1.0)

    @property
    def mode(self):
        return tf.fill(tf.shape(self.low), tf.constant(float("nan"), self.low.dtype))
