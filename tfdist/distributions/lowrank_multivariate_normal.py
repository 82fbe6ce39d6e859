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

    @property
    def scale_tril(self):
        """Lower Cholesky factor of the covariance, as torch forms it: D^1/2 chol(I + D^-1/2 W W^T D^-1/2)."""
        n = int(self.loc.shape[-1])
        sqrt_d = tf.sqrt(self.cov_diag)[..., None]
        w = self.cov_factor / sqrt_d
        k = tf.matmul(w, w, transpose_b=True) + tf.eye(n, dtype=w.dtype)
        return self._expand_matrix(sqrt_d * tf.linalg.cholesky(k))

    @property
    def precision_matrix(self):
        """Inverse covariance by Woodbury, as torch: D^-1 - A^T A, A = chol(I + W^T D^-1 W)^-1 W^T D^-1."""
        m = int(self.cov_factor.shape[-1])
        wt_dinv = tf.linalg.matrix_transpose(self.cov_factor) / self.cov_diag[..., None, :]
        capacitance = tf.matmul(wt_dinv, self.cov_factor) + tf.eye(m, dtype=self.loc.dtype)
        a = tf.linalg.triangular_solve(tf.linalg.cholesky(capacitance), wt_dinv, lower=True)
        return self._expand_matrix(tf.linalg.diag(1.0 / self.cov_diag) - tf.matmul(a, a, transpose_a=True))

    def _expand_matrix(self, m):
        return tf.broadcast_to(m, self.batch_shape.concatenate(self.event_shape).concatenate(self.event_shape))

    def _tfp(self):
        return tfd().MultivariateNormalTriL(self.loc, tf.linalg.cholesky(self.covariance_matrix))

    @property
    def mode(self):
        return self.loc
