"""InverseGamma with torch's parameterisation (torch.distributions.inverse_gamma)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["InverseGamma"]


_InverseGamma = _positive_pair("InverseGamma", "InverseGamma", "concentration", "rate", constraints.positive,
                              lambda c, r: {"concentration": c, "scale": r})


class InverseGamma(_InverseGamma):
    __doc__ = _InverseGamma.__doc__

    @property
    def mean(self):
        """rate / (concentration - 1); infinite for concentration <= 1, as torch."""
        c, r = self.concentration, self.rate
        return tf.where(c > 1, r / tf.maximum(c - 1, 1e-30), tf.zeros_like(c) + float("inf"))

    @property
    def variance(self):
        """Infinite for concentration <= 2, as torch."""
        c, r = self.concentration, self.rate
        finite = tf.square(r) / (tf.square(c - 1) * tf.maximum(c - 2, 1e-30))
        return tf.where(c > 2, finite, tf.zeros_like(c) + float("inf"))
