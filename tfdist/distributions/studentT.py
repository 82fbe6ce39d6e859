"""StudentT with torch's parameterisation (torch.distributions.studentT)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import _TFPBacked, tfd
from tfdist.distributions.utils import broadcast_all

__all__ = ["StudentT"]


class StudentT(_TFPBacked):
    """StudentT(df, loc=0.0, scale=1.0)."""

    arg_constraints = {"df": constraints.positive, "loc": constraints.real, "scale": constraints.positive}
    support = constraints.real
    has_rsample = True
    _params = ("df", "loc", "scale")

    def __init__(self, df, loc=0.0, scale=1.0, validate_args=None):
        self.df, self.loc, self.scale = broadcast_all(df, loc, scale)
        super().__init__(self.df.shape, (), validate_args)

    def _tfp(self):
        return tfd().StudentT(self.df, self.loc, self.scale)

    @property
    def variance(self):
        # torch: inf for 1 < df <= 2, nan for df <= 1
        var = self.scale ** 2 * self.df / (self.df - 2)
        var = tf.where(self.df <= 2, tf.constant(float("inf"), var.dtype), var)
        return tf.where(self.df <= 1, tf.constant(float("nan"), var.dtype), var)
