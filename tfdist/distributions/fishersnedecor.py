"""FisherSnedecor with torch's parameterisation (torch.distributions.fishersnedecor)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import _TFPBacked, tfd
from tfdist.distributions.utils import as_shape, broadcast_all

__all__ = ["FisherSnedecor"]


class FisherSnedecor(_TFPBacked):
    """FisherSnedecor(df1, df2): the F distribution (closed-form density; chi-square ratio samples)."""

    arg_constraints = {"df1": constraints.positive, "df2": constraints.positive}
    support = constraints.positive
    has_rsample = True
    _params = ("df1", "df2")

    def __init__(self, df1, df2, validate_args=None):
        self.df1, self.df2 = broadcast_all(df1, df2)
        super().__init__(self.df1.shape, (), validate_args)

    def rsample(self, sample_shape=()):
        shape = as_shape(sample_shape)
        x1 = tfd().Chi2(self.df1).sample(shape) / self.df1
        x2 = tfd().Chi2(self.df2).sample(shape) / self.df2
        return x1 / x2

    def log_prob(self, value):
        self._validate_sample(value)
        x = tf.cast(value, self.df1.dtype)
        d1, d2 = self.df1, self.df2
        lbeta = tf.math.lgamma(d1 / 2) + tf.math.lgamma(d2 / 2) - tf.math.lgamma((d1 + d2) / 2)
        return (d1 / 2 * tf.math.log(d1 / d2) + (d1 / 2 - 1) * tf.math.log(x)
                - (d1 + d2) / 2 * tf.math.log1p(d1 * x / d2) - lbeta)

    @property
    def mean(self):
        m = self.df2 / (self.df2 - 2)
        return tf.where(self.df2 > 2, m, tf.constant(float("nan"), m.dtype))

    @property
    def variance(self):
        d1, d2 = self.df1, self.df2
        v = 2 * d2 ** 2 * (d1 + d2 - 2) / (d1 * (d2 - 2) ** 2 * (d2 - 4))
        return tf.where(d2 > 4, v, tf.constant(float("nan"), v.dtype))

    @property
    def mode(self):
        """(df1 - 2) / df1 * df2 / (df2 + 2); NaN for df1 <= 2 (as torch)."""
        d1, d2 = self.df1, self.df2
        m = (d1 - 2) / d1 * d2 / (d2 + 2)
        return tf.where(d1 > 2, m, tf.constant(float("nan"), m.dtype))
