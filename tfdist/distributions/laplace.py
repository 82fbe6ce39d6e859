"""Laplace with torch's parameterisation (torch.distributions.laplace)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["Laplace"]


_Laplace = _two("Laplace", "Laplace", "loc", "scale", constraints.real)


class Laplace(_Laplace):
    __doc__ = _Laplace.__doc__

    # torch's closed forms (the same values as TFP's for a positive scale; torch's for validate_args=False
    # and a negative one)
    def cdf(self, value):
        self._validate_sample(value)
        z = tf.cast(value, self._dtype) - self.loc
        return 0.5 - 0.5 * tf.sign(z) * tf.math.expm1(-tf.abs(z) / self.scale)

    def icdf(self, value):
        term = tf.cast(value, self._dtype) - 0.5
        return self.loc - self.scale * tf.sign(term) * tf.math.log1p(-2 * tf.abs(term))
