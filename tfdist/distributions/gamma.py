"""Gamma with torch's parameterisation (torch.distributions.gamma)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Gamma"]


_Gamma = _positive_pair("Gamma", "Gamma", "concentration", "rate", constraints.nonnegative,
                       lambda c, r: {"concentration": c, "rate": r}, exp_family=True)


class Gamma(_Gamma):
    __doc__ = _Gamma.__doc__

    @property
    def mode(self):
        """max(concentration - 1, 0) / rate: the edge of the support for concentration <= 1, as torch."""
        return tf.maximum(self.concentration - 1, 0.0) / self.rate
