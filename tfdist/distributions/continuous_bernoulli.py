"""ContinuousBernoulli with torch's parameterisation (torch.distributions.continuous_bernoulli)."""

from __future__ import annotations

import math

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ParamShape, _ProbsLogits, clamp_probs
from tfdist.distributions._tfp_backed import tfd

__all__ = ["ContinuousBernoulli"]


class ContinuousBernoulli(_ParamShape, _ProbsLogits):
    """ContinuousBernoulli(probs|logits, lims=(0.499, 0.501)): torch's values, Taylor-expanded inside ``lims``."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.unit_interval
    has_rsample = True

    def __init__(self, probs=None, logits=None, lims=(0.499, 0.501), validate_args=None):
        self._set_probs_logits(probs, logits)
        self._lims = lims
        param = self._probs_value if self._given == "probs" else self._logits_value
        super().__init__(param.shape, (), validate_args)

    def _extra_kwargs(self):
        return {"lims": self._lims}

    def _tfp(self):
        return tfd().ContinuousBernoulli(logits=self.logits)  # sampling only; the values below are torch's

    # torch's formulas: outside ``lims`` the closed forms at the probability, inside a Taylor expansion
    # around 1/2 (cdf and icdf: the uniform's), so values near p = 1/2 match torch's to the last digit
    @property
    def _p(self):
        return clamp_probs(tf.convert_to_tensor(self.probs))

    def _outside(self):
        p = self._p
        return tf.logical_or(p <= self._lims[0], p > self._lims[1])

    def _cut(self):
        p = self._p
        return tf.where(self._outside(), p, tf.zeros_like(p) + self._lims[0])

    def _log_norm(self):
        cut = self._cut()
        below = tf.where(cut <= 0.5, cut, tf.zeros_like(cut))
        above = tf.where(cut >= 0.5, cut, tf.ones_like(cut))
        log_norm = tf.math.log(tf.abs(tf.math.log1p(-cut) - tf.math.log(cut))) - tf.where(
            cut <= 0.5, tf.math.log1p(-2.0 * below), tf.math.log(2.0 * above - 1.0))
        x = tf.square(self._p - 0.5)
        taylor = math.log(2.0) + (4.0 / 3.0 + 104.0 / 45.0 * x) * x
        return tf.where(self._outside(), log_norm, taylor)

    @property
    def mean(self):
        cut = self._cut()
        mus = cut / (2.0 * cut - 1.0) + 1.0 / (tf.math.log1p(-cut) - tf.math.log(cut))
        x = self._p - 0.5
        return tf.where(self._outside(), mus, 0.5 + (1.0 / 3.0 + 16.0 / 45.0 * tf.square(x)) * x)

    @property
    def variance(self):
        cut = self._cut()
        v = cut * (cut - 1.0) / tf.square(1.0 - 2.0 * cut) + 1.0 / tf.square(tf.math.log1p(-cut) - tf.math.log(cut))
        x = tf.square(self._p - 0.5)
        return tf.where(self._outside(), v, 1.0 / 12.0 - (1.0 / 15.0 - 128.0 / 945.0 * x) * x)

    def log_prob(self, value):
        self._validate_sample(value)
        p = self._p
        value = tf.cast(value, p.dtype)
        logits = tf.math.log(p) - tf.math.log1p(-p)
        return -tf.nn.sigmoid_cross_entropy_with_logits(labels=value + tf.zeros_like(logits),
                                                         logits=logits + tf.zeros_like(value)) + self._log_norm()

    def cdf(self, value):
        self._validate_sample(value)
        cut = self._cut()
        value = tf.cast(value, cut.dtype)
        cdfs = (tf.pow(cut, value) * tf.pow(1.0 - cut, 1.0 - value) + cut - 1.0) / (2.0 * cut - 1.0)
        unbounded = tf.where(self._outside(), cdfs, value)
        return tf.where(value <= 0.0, tf.zeros_like(unbounded), tf.where(value >= 1.0, tf.ones_like(unbounded),
                                                                          unbounded))

    def icdf(self, value):
        cut = self._cut()
        value = tf.cast(value, cut.dtype)
        inverse = (tf.math.log1p(-cut + value * (2.0 * cut - 1.0)) - tf.math.log1p(-cut)) / (
            tf.math.log(cut) - tf.math.log1p(-cut))
        return tf.where(self._outside(), inverse, value)

    def entropy(self):
        p = self._p
        log0, log1 = tf.math.log1p(-p), tf.math.log(p)
        return self.mean * (log0 - log1) - self._log_norm() - log0
