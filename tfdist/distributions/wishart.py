"""Wishart with torch's parameterisation (torch.distributions.wishart)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints, distribution
from tfdist.distributions._tfp_backed import _TFPBacked, tfd

__all__ = ["Wishart"]


class Wishart(_TFPBacked):
    """Wishart(df, covariance_matrix|precision_matrix|scale_tril)."""

    arg_constraints = {"covariance_matrix": constraints.positive_definite,
                       "precision_matrix": constraints.positive_definite,
                       "scale_tril": constraints.lower_cholesky}
    support = constraints.positive_definite
    has_rsample = True
    _params = ("df", "scale_tril")
    _param_event_ndims = {"scale_tril": 2}

    def __init__(self, df, covariance_matrix=None, precision_matrix=None, scale_tril=None, validate_args=None):
        given = [m for m in (covariance_matrix, precision_matrix, scale_tril) if m is not None]
        if len(given) != 1:
            raise ValueError("Exactly one of covariance_matrix or precision_matrix or scale_tril may be specified.")
        m = tf.convert_to_tensor(given[0], dtype_hint=tf.float32)
        if scale_tril is not None:
            self.scale_tril = m
        elif covariance_matrix is not None:
            self.scale_tril = tf.linalg.cholesky(m)
        else:
            self.scale_tril = tf.linalg.cholesky(tf.linalg.inv(m))
        self.df = tf.cast(df, m.dtype)
        p = m.shape[-1]
        if self._validate_default() and bool(tf.reduce_any(self.df <= p - 1)):
            raise ValueError(f"Expected parameter df to be greater than {p - 1} (the event size minus one).")
        super().__init__(m.shape[:-2], m.shape[-2:], validate_args)

    @staticmethod
    def _validate_default():
        # read at call time: set_default_validate_args rebinds the module global
        return distribution._VALIDATE_DEFAULT and tf.executing_eagerly()

    @property
    def covariance_matrix(self):
        return tf.matmul(self.scale_tril, self.scale_tril, transpose_b=True)

    def _tfp(self):
        return tfd().WishartTriL(df=self.df, scale_tril=self.scale_tril)
