"""Binomial with torch's parameterisation (torch.distributions.binomial)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ParamShape, _ProbsLogits, _Support
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.utils import broadcast_all

__all__ = ["Binomial"]


class Binomial(_ParamShape, _ProbsLogits):
    """Binomial(total_count=1, probs=None, logits=None)."""

    arg_constraints = {"total_count": constraints.nonnegative_integer, "probs": constraints.unit_interval,
                       "logits": constraints.real}
    has_enumerate_support = True
    support = _Support(lambda self: constraints.integer_interval(0, self.total_count))

    def __init__(self, total_count=1, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        param = self._probs_value if self._given == "probs" else self._logits_value
        self.total_count, param = broadcast_all(total_count, param)
        if self._given == "probs":
            self._probs_value = param
        else:
            self._logits_value = param
        super().__init__(param.shape, (), validate_args)

    @property
    def _params(self):
        return (self._given, "total_count")

    def _tfp(self):
        if self._given == "probs":
            # torch works from logits of probs clamped to [eps, 1 - eps]: finite log-probabilities at 0 and 1
            return tfd().Binomial(total_count=self.total_count, logits=self.logits)
        return tfd().Binomial(total_count=self.total_count, logits=self._logits_value)

    @property
    def mean(self):
        return self.total_count * self.probs

    @property
    def variance(self):
        return self.total_count * self.probs * (1 - self.probs)

    def entropy(self):
        """-sum_k p(k) log p(k) over the support 0..n (torch enumerates it too)."""
        n = tf.reduce_max(self.total_count)
        if not bool(tf.reduce_all(tf.equal(self.total_count, n))):
            raise NotImplementedError("Inhomogeneous total count not supported by `entropy`.")
        log_prob = self.log_prob(self.enumerate_support(expand=False))
        # 0 log 0 = 0 (p = 0 or 1 puts all mass on one count)
        return -tf.reduce_sum(tf.math.multiply_no_nan(log_prob, tf.exp(log_prob)), axis=0)

    def enumerate_support(self, expand=True):
        n = tf.reduce_max(self.total_count)
        if not bool(tf.reduce_all(tf.equal(self.total_count, n))):
            raise NotImplementedError("Inhomogeneous total count not supported by `enumerate_support`.")
        values = tf.range(n + 1, dtype=self._dtype)
        values = tf.reshape(values, [-1] + [1] * len(self.batch_shape))
        return tf.broadcast_to(values, [int(n) + 1] + self.batch_shape.as_list()) if expand else values
