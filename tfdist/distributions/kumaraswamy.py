"""Kumaraswamy with torch's parameterisation (torch.distributions.kumaraswamy)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Kumaraswamy"]


_Kumaraswamy = _positive_pair("Kumaraswamy", "Kumaraswamy", "concentration1", "concentration0",
                              constraints.unit_interval, lambda a, b: {"concentration1": a, "concentration0": b})


class Kumaraswamy(_Kumaraswamy):
    __doc__ = _Kumaraswamy.__doc__

    # beyond [0, 1] (validate_args=False) TFP's formulas give NaN; the density is 0 there, as torch answers
    def log_prob(self, value):
        self._validate_sample(value)  # the value itself: the one passed on below is made safe
        x = tf.cast(value, self._dtype)
        inside = tf.logical_and(x >= 0, x <= 1)
        lp = super().log_prob(tf.where(inside, x, tf.constant(0.5, x.dtype)))
        return tf.where(inside, lp, tf.constant(-float("inf"), lp.dtype))

    def cdf(self, value):
        self._validate_sample(value)
        return super().cdf(tf.clip_by_value(tf.cast(value, self._dtype), 0.0, 1.0))
