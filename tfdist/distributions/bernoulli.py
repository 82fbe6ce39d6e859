"""Bernoulli with torch's parameterisation (torch.distributions.bernoulli)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ParamShape, _ProbsLogits
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.exp_family import ExponentialFamily

__all__ = ["Bernoulli"]


class Bernoulli(_ParamShape, _ProbsLogits, ExponentialFamily):
    """Bernoulli(probs=None, logits=None)."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.boolean
    has_enumerate_support = True

    def __init__(self, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        shape = (self._probs_value if self._given == "probs" else self._logits_value).shape
        super().__init__(shape, (), validate_args)

    def _tfp(self):
        return tfd().Bernoulli(logits=self.logits, dtype=self._dtype)

    def enumerate_support(self, expand=True):
        values = tf.reshape(tf.constant([0.0, 1.0], self._dtype), [2] + [1] * len(self.batch_shape))
        return tf.broadcast_to(values, [2] + self.batch_shape.as_list()) if expand else values

    @property
    def mean(self):
        return tf.identity(self.probs)

    @property
    def variance(self):
        return self.probs * (1 - self.probs)

    @property
    def mode(self):
        """1 where probs > 0.5, 0 below, NaN at 0.5 (two modes), as torch."""
        p = self.probs
        return tf.where(tf.equal(p, 0.5), tf.constant(float("nan"), p.dtype), tf.cast(p > 0.5, p.dtype))

    def entropy(self):
        p, logits = self.probs, self.logits
        return tf.nn.softplus(logits) - p * logits
