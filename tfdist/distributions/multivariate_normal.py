"""MultivariateNormal with torch's parameterisation (torch.distributions.multivariate_normal)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints, distribution
from tfdist.distributions._tfp_backed import _TFPBacked, tfd
from tfdist.distributions.utils import as_float_tensor

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
        loc = as_float_tensor(loc)
        if loc.shape.rank < 1:
            raise ValueError("loc must be at least one-dimensional.")
        validate = distribution._VALIDATE_DEFAULT if validate_args is None else validate_args
        if scale_tril is not None:
            self.scale_tril = tf.cast(scale_tril, loc.dtype)
            self._given = "scale_tril"
        elif covariance_matrix is not None:
            matrix = _checked("covariance_matrix", tf.cast(covariance_matrix, loc.dtype), validate)
            self.scale_tril = _cholesky("covariance_matrix", matrix)
            self._given = "covariance_matrix"
        else:
            matrix = _checked("precision_matrix", tf.cast(precision_matrix, loc.dtype), validate)
            self.scale_tril = _cholesky("precision_matrix", tf.linalg.inv(matrix))
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


def _checked(name: str, matrix: tf.Tensor, validate: bool) -> tf.Tensor:
    """With validation (eager), a matrix that is not symmetric positive definite is a ValueError
    naming the parameter (before a Cholesky would take its lower triangle or fail)."""
    if validate and tf.executing_eagerly() and not bool(tf.reduce_all(constraints.positive_definite.check(matrix))):
        raise ValueError(
            f"Expected parameter {name} (Tensor of shape {tuple(matrix.shape)}) of distribution "
            f"MultivariateNormal to satisfy the constraint PositiveDefinite() (symmetric, all "
            f"eigenvalues > 0), but found invalid values:\n{matrix}"
        )
    return matrix


def _cholesky(name: str, matrix: tf.Tensor) -> tf.Tensor:
    """Cholesky factor; without validation a failing factorisation still names the parameter."""
    try:
        return tf.linalg.cholesky(matrix)
    except tf.errors.InvalidArgumentError as error:
        raise ValueError(
            f"MultivariateNormal: {name} is not positive definite (Cholesky failed: {error.message})"
        ) from None
