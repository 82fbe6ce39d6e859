"""Wishart with torch's parameterisation (torch.distributions.wishart)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import tensorflow as tf

from tfdist.distributions import constraints, distribution
from tfdist.distributions._tfp_backed import _TFPBacked
from tfdist.distributions.utils import as_shape

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

    @property
    def precision_matrix(self):
        """The inverse of ``covariance_matrix``, from its Cholesky factor (torch's ``cholesky_solve``)."""
        eye = tf.eye(self._p, batch_shape=self.scale_tril.shape[:-2], dtype=self.scale_tril.dtype)
        return tf.linalg.cholesky_solve(self.scale_tril, eye)

    # torch's closed forms, written out because TFP's WishartTriL refuses p - 1 < df < p, which
    # torch (and the distribution) allow.
    @property
    def _p(self) -> int:
        return int(self.scale_tril.shape[-1])

    def _df_matrix(self, df):
        return tf.reshape(df, tf.concat([tf.shape(df), [1, 1]], 0))

    def _half_log_det_scale(self):
        """p log(2) / 2 + log|L|: the normaliser shared by log_prob and entropy."""
        diag = tf.linalg.diag_part(self.scale_tril)
        return self._p * math.log(2.0) / 2 + tf.reduce_sum(tf.math.log(diag), -1)

    @property
    def mean(self):
        return self._df_matrix(self.df) * self.covariance_matrix

    @property
    def mode(self):
        factor = self.df - self._p - 1
        factor = tf.where(factor > 0, factor, tf.constant(math.nan, factor.dtype))  # no mode for df <= p + 1
        return self._df_matrix(factor) * self.covariance_matrix

    @property
    def variance(self):
        v = self.covariance_matrix
        d = tf.linalg.diag_part(v)
        return self._df_matrix(self.df) * (v ** 2 + d[..., :, None] * d[..., None, :])

    def log_prob(self, value):
        self._validate_sample(value)
        value = tf.cast(value, self.df.dtype)
        nu, p = self.df, self._p
        scaled = tf.linalg.cholesky_solve(self.scale_tril, value)  # Sigma^-1 X
        _, log_det = tf.linalg.slogdet(value)
        return (-nu * self._half_log_det_scale() - _mvlgamma(nu / 2, p) + (nu - p - 1) / 2 * log_det
                - tf.linalg.trace(scaled) / 2)

    def entropy(self):
        nu, p = self.df, self._p
        return ((p + 1) * self._half_log_det_scale() + _mvlgamma(nu / 2, p)
                - (nu - p - 1) / 2 * _mvdigamma(nu / 2, p) + nu * p / 2)

    def cdf(self, value):
        raise NotImplementedError  # as torch

    def icdf(self, value):
        raise NotImplementedError  # as torch

    def rsample(self, sample_shape=(), max_try_correction=None):
        """Bartlett decomposition (as torch): L A A^T L^T, A lower triangular with sqrt(chi2(df - i))
        on the diagonal and standard normals below it; valid for every df > p - 1.

        A sample that comes out singular in floating point (not positive definite) is drawn again,
        up to ``max_try_correction`` times (torch's default: 10, or 3 inside a traced function);
        one still singular after that is returned with a warning, as torch does.
        """
        if max_try_correction is None:
            max_try_correction = 10 if tf.executing_eagerly() else 3
        if isinstance(max_try_correction, bool) or not isinstance(max_try_correction, int) or max_try_correction < 0:
            raise ValueError("max_try_correction must be a non-negative int or None. Received: "
                             f"max_try_correction={max_try_correction!r}")
        shape = as_shape(sample_shape).concatenate(self.batch_shape)
        sample = self._bartlett(shape)
        for _ in range(max_try_correction):
            singular = tf.reduce_any(tf.linalg.eigvalsh(sample) <= 0, axis=-1)[..., None, None]
            if tf.executing_eagerly() and not bool(tf.reduce_any(singular)):
                return sample
            sample = tf.where(singular, self._bartlett(shape), sample)
        if tf.executing_eagerly() and bool(tf.reduce_any(tf.linalg.eigvalsh(sample) <= 0)):
            warnings.warn(f"Wishart.rsample: singular samples remain after max_try_correction={max_try_correction} "
                          "draws; their log_prob is -inf. Check df or raise max_try_correction.", stacklevel=2)
        return sample

    def _bartlett(self, shape):
        p, dtype = self._p, self.df.dtype
        dof = tf.broadcast_to(self.df, shape)[..., None] - tf.range(p, dtype=dtype)
        chi2 = 2.0 * tf.random.gamma([], dof / 2, dtype=dtype)
        eps = float(np.finfo(dtype.as_numpy_dtype).eps)
        noise = tf.linalg.band_part(tf.random.normal(shape.concatenate([p, p]), dtype=dtype), -1, 0)
        a = tf.linalg.set_diag(noise, tf.maximum(tf.sqrt(chi2), eps))  # torch clamps it above eps too
        la = tf.matmul(self.scale_tril, a)
        return tf.matmul(la, la, transpose_b=True)

    def _sample(self, sample_shape):
        return tf.stop_gradient(self.rsample(sample_shape))


def _mvlgamma(a, p: int):
    """log of the multivariate gamma function Gamma_p(a)."""
    i = tf.range(p, dtype=a.dtype) / 2
    return p * (p - 1) / 4 * math.log(math.pi) + tf.reduce_sum(tf.math.lgamma(a[..., None] - i), -1)


def _mvdigamma(a, p: int):
    """d/da log Gamma_p(a)."""
    return tf.reduce_sum(tf.math.digamma(a[..., None] - tf.range(p, dtype=a.dtype) / 2), -1)
