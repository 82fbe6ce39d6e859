"""Weibull with torch's parameterisation (torch.distributions.weibull)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Weibull"]


_Weibull = _positive_pair("Weibull", "Weibull", "scale", "concentration", constraints.positive,
                          lambda s, k: {"concentration": k, "scale": s})


class Weibull(_Weibull):
    __doc__ = _Weibull.__doc__

    # below 0 (validate_args=False) TFP gives NaN and torch a finite number from its transforms; the
    # density is 0 there
    def log_prob(self, value):
        self._validate_sample(value)  # the value itself: the one passed on below is made safe
        x = tf.cast(value, self._dtype)
        lp = super().log_prob(tf.where(x >= 0, x, tf.ones_like(x)))
        return tf.where(x >= 0, lp, tf.constant(-float("inf"), lp.dtype))
