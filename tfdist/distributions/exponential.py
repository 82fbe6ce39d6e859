"""Exponential with torch's parameterisation (torch.distributions.exponential)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["Exponential"]


_Exponential = _one("Exponential", "rate", lambda r: tfd().Exponential(r), constraints.nonnegative,
                   exp_family=True)


class Exponential(_Exponential):
    __doc__ = _Exponential.__doc__

    @property
    def mode(self):
        """The density is largest at 0."""
        return tf.zeros_like(self.rate)
