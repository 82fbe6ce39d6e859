"""Chi2 with torch's parameterisation (torch.distributions.chi2)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["Chi2"]


_Chi2 = _one("Chi2", "df", lambda df: tfd().Chi2(df), constraints.nonnegative)


class Chi2(_Chi2):
    __doc__ = _Chi2.__doc__

    @property
    def mode(self):
        """max(df - 2, 0): the edge of the support for df <= 2, as torch."""
        return tf.maximum(self.df - 2, 0.0)
