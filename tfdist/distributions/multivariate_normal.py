"""MultivariateNormal with torch's parameterisation (torch.distributions.multivariate_normal)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import _TFPBacked, tfd

__all__ = ["MultivariateNormal"]


class MultivariateNormal(_TFPBacked):
    """MultivariateNormal(loc, covariance_matrix=None, precision_matrix=None, scale_tril=None)."""

    arg_constraints = {"loc": constraints.real_vector, "covariance_matrix": constraints.positive_definite,
                       "precision_matrix": constraints.positive_definite, "scale_tril": constraints.lower_cholesky}
    support = constraints.real_vector
    has_rsample = True
    _param_event_ndims = {"loc": 1, "scale_tril": 2}

    def __init__(self, loc, covariance_matrix=None, precision_matrix=None, scale_tril=None, validate_args=None):
        given = [m for m in (covariance_matrix, precision_matrix, scale_tril) if m is not None]
        if len(given) != 1:
            raise ValueError(
                "Exactly one of covariance_matrix or precision_matrix or scale_tril may be specified."
            )
        loc = tf.convert_to_tensor(loc, dtype_hint=tf.float32)
        if loc.shape.rank < 1:
            raise ValueError("loc must be at least one-dimensional.")
        if scale_tril is not None:
            self.scale_tril = tf.cast(scale_tril, loc.dtype)
            self._given = "scale_tril"
        elif covariance_matrix is not None:
            self.scale_tril = tf.linalg.cholesky(tf.cast(covariance_matrix, loc.dtype))
            self._given = "covariance_matrix"
        else:
            self.scale_tril = tf.linalg.cholesky(tf.linalg.inv(tf.cast(precision_matrix, loc.dtype)))
            self._given = "precision_matrix"
        batch = tf.broadcast_static_shape(loc.shape[:-1], self.scale_tril.shape[:-2])
        self.loc = tf.broadcast_to(loc, batch.concatenate(loc.shape[-1:]))
        self.scale_tril = tf.broadcast_to(self.scale_tril, batch.concatenate(self.scale_tril.shape[-2:]))
        super().__init__(batch, loc.shape[-1:], validate_args)

    _params = ("loc", "scale_tril")

    def _tfp(self):
        return tfd().MultivariateNormalTriL(self.loc, self.scale_tril)

    @property
    def covariance_matrix(self):
        return tf.matmul(self.scale_tril, self.scale_tril, transpose_b=True)

    @property
    def precision_matrix(self):
        return tf.linalg.inv(self.covariance_matrix)

    @property
    def mode(self):
        return self.loc
