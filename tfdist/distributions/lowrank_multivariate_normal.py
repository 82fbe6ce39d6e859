"""LowRankMultivariateNormal with torch's parameterisation (torch.distributions.lowrank_multivariate_normal)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import _TFPBacked, tfd
from tfdist.distributions.utils import as_float_tensor

__all__ = ["LowRankMultivariateNormal"]


class LowRankMultivariateNormal(_TFPBacked):
    """LowRankMultivariateNormal(loc, cov_factor, cov_diag): covariance W W^T + diag(D)."""

    arg_constraints = {"loc": constraints.real_vector, "cov_factor": constraints.independent(constraints.real, 2),
                       "cov_diag": constraints.independent(constraints.positive, 1)}
    support = constraints.real_vector
    has_rsample = True
    _params = ("loc", "cov_factor", "cov_diag")
    _param_event_ndims = {"loc": 1, "cov_factor": 2, "cov_diag": 1}

    def __init__(self, loc, cov_factor, cov_diag, validate_args=None):
        loc = as_float_tensor(loc)
        self.cov_factor = tf.cast(cov_factor, loc.dtype)
        self.cov_diag = tf.cast(cov_diag, loc.dtype)
        if self.cov_factor.shape[-2] != loc.shape[-1]:
            raise ValueError(
                f"cov_factor must be a batch of matrices with shape {loc.shape[-1]} x m. "
                f"Received: cov_factor shape {tuple(self.cov_factor.shape)}"
            )
        batch = tf.broadcast_static_shape(loc.shape[:-1], self.cov_factor.shape[:-2])
        self.loc = tf.broadcast_to(loc, batch.concatenate(loc.shape[-1:]))
        super().__init__(batch, loc.shape[-1:], validate_args)

    @property
    def covariance_matrix(self):
        return tf.matmul(self.cov_factor, self.cov_factor, transpose_b=True) + tf.linalg.diag(self.cov_diag)

    def _tfp(self):
        return tfd().MultivariateNormalTriL(self.loc, tf.linalg.cholesky(self.covariance_matrix))

    @property
    def mode(self):
        return self.loc
