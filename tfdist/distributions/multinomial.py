"""Multinomial with torch's parameterisation (torch.distributions.multinomial)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.categorical import Categorical, _OverCategorical
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.utils import as_shape

__all__ = ["Multinomial"]


class Multinomial(_OverCategorical, Distribution):
    """Multinomial(total_count=1, probs|logits): counts over K categories."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}

    def __init__(self, total_count=1, probs=None, logits=None, validate_args=None):
        if not isinstance(total_count, int):
            raise NotImplementedError("inhomogeneous total_count is not supported")
        self.total_count = total_count
        self._categorical = Categorical(probs=probs, logits=logits, validate_args=validate_args)
        super().__init__(self._categorical.batch_shape, (self._categorical._num_events,), validate_args)

    @property
    def support(self):
        return constraints.multinomial(self.total_count)

    def _tfp(self):
        return tfd().Multinomial(total_count=float(self.total_count), logits=self._categorical.logits)

    def sample(self, sample_shape=()):
        return self._tfp().sample(as_shape(sample_shape))

    def log_prob(self, value):
        self._validate_sample(value)
        return self._tfp().log_prob(tf.cast(value, self.probs.dtype))

    def expand(self, batch_shape, _instance=None):
        return Multinomial(self.total_count, logits=self._categorical.expand(batch_shape).logits)

    def entropy(self):
        """torch's formula: n H(categorical) - lgamma(n + 1) + sum_k E[lgamma(x_k + 1)], each x_k
        Binomial(n, p_k), the expectation taken over its support 0..n."""
        n = self.total_count
        probs = self.probs
        counts = tf.cast(tf.range(n + 1), probs.dtype)  # [n + 1]
        p = probs[..., tf.newaxis]  # [..., K, 1]
        log_pmf = (tf.math.lgamma(tf.cast(n + 1, probs.dtype)) - tf.math.lgamma(counts + 1)
                   - tf.math.lgamma(n - counts + 1)
                   + tf.math.xlogy(counts, p) + tf.math.xlog1py(n - counts, -p))
        expected = tf.reduce_sum(tf.exp(log_pmf) * tf.math.lgamma(counts + 1), axis=[-1, -2])
        return n * self._categorical.entropy() - tf.math.lgamma(tf.cast(n + 1, probs.dtype)) + expected

    @property
    def mean(self):
        return self.total_count * self.probs

    @property
    def variance(self):
        return self.total_count * self.probs * (1 - self.probs)
