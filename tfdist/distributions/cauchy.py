"""Cauchy with torch's parameterisation (torch.distributions.cauchy)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["Cauchy"]


_Cauchy = _two("Cauchy", "Cauchy", "loc", "scale", constraints.real)


class Cauchy(_Cauchy):
    __doc__ = _Cauchy.__doc__

    @property
    def variance(self):
        """Infinite (the integral diverges), as torch."""
        return tf.zeros_like(self.loc) + float("inf")
