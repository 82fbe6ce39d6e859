"""Transforms (torch.distributions.transforms): invertible maps with log|det J|.

``t(x)`` maps forward, ``t.inv`` is the inverse transform, and
``t.log_abs_det_jacobian(x, y)`` is the log absolute Jacobian determinant,
summed over ``t.domain.event_dim`` trailing dims.  ``cache_size=1`` caches the
last ``(x, y)`` pair, so ``t.inv(t(x))`` returns ``x`` itself.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions.utils import _sum_rightmost

__all__ = [
    "Transform", "ComposeTransform", "ExpTransform", "AffineTransform", "SigmoidTransform",
    "TanhTransform", "SoftplusTransform", "PowerTransform", "AbsTransform", "IndependentTransform",
    "ReshapeTransform", "SoftmaxTransform", "StickBreakingTransform", "LowerCholeskyTransform",
    "CumulativeDistributionTransform", "identity_transform",
]



def _check_rank(transform, value, event_dim: int, name: str) -> None:
    """A value with fewer dims than the transform's event reads wrongly in TF's kernels: refused naming it."""
    shape = getattr(value, "shape", None)
    if isinstance(shape, tf.TensorShape):
        rank = shape.rank  # None: unknown while tracing
    else:
        rank = len(shape) if shape is not None else np.ndim(value)
    if rank is not None and rank < event_dim:
        shown = tuple(shape) if shape is not None else np.shape(value)
        raise ValueError(f"{type(transform).__name__}: {name} must have at least {event_dim} dims (its event "
                         f"dims). Received: {name} of shape {shown}")


class Transform:
    """Base class: subclasses define ``_call``, ``_inverse`` and ``log_abs_det_jacobian``."""

    bijective = False
    domain: constraints.Constraint = constraints.real
    codomain: constraints.Constraint = constraints.real

    def __init__(self, cache_size: int = 0) -> None:
        if cache_size not in (0, 1):
            raise ValueError(f"cache_size must be 0 or 1. Received: cache_size={cache_size!r}")
        self._cache_size = cache_size
        self._cached_x_y = (None, None)
        self._inv = None

    @property
    def event_dim(self) -> int:
        return self.domain.event_dim

    @property
    def sign(self) -> int:
        raise NotImplementedError

    @property
    def inv(self) -> Transform:
        if self._inv is None:
            self._inv = _InverseTransform(self)
        return self._inv

    def with_cache(self, cache_size: int = 1) -> Transform:
        if self._cache_size == cache_size:
            return self
        raise NotImplementedError(f"{type(self).__name__}.with_cache is not implemented")

    def __call__(self, x):
        _check_rank(self, x, self.domain.event_dim, "x")
        if self._cache_size == 0:
            return self._call(x)
        x_old, y_old = self._cached_x_y
        if x is x_old:
            return y_old
        y = self._call(x)
        self._cached_x_y = (x, y)
        return y

    def _inv_call(self, y):
        _check_rank(self, y, self.codomain.event_dim, "y")
        if self._cache_size == 0:
            return self._inverse(y)
        x_old, y_old = self._cached_x_y
        if y is y_old:
            return x_old
        x = self._inverse(y)
        self._cached_x_y = (x, y)
        return x

    def _call(self, x):
        raise NotImplementedError

    def _inverse(self, y):
        raise NotImplementedError

    def log_abs_det_jacobian(self, x, y):
        raise NotImplementedError

    def forward_shape(self, shape):
        return shape

    def inverse_shape(self, shape):
        return shape

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return f"{type(self).__name__}()"


class _Stateless:
    """torch: transforms without parameters are equal to every instance of their class."""

    def __eq__(self, other):
        return isinstance(other, type(self))

    def __hash__(self):
        return hash(type(self))


def _same_values(a, b) -> bool:
    """torch's parameter equality (``(a == b).all().item()``); symbolic values only equal themselves."""
    if a is b:
        return True
    try:
        return bool(tf.reduce_all(tf.equal(tf.convert_to_tensor(a), tf.convert_to_tensor(b))).numpy())
    except (AttributeError, TypeError, ValueError, tf.errors.InvalidArgumentError):
        return False  # symbolic (inside tf.function) or not broadcastable


class _InverseTransform(Transform):
    def __init__(self, transform: Transform) -> None:
        super().__init__(cache_size=transform._cache_size)
        self._inv = transform

    @property
    def domain(self):
        return self._inv.codomain

    @property
    def codomain(self):
        return self._inv.domain

    @property
    def bijective(self):
        return self._inv.bijective

    @property
    def sign(self):
        return self._inv.sign

    @property
    def inv(self):
        return self._inv

    def __call__(self, x):
        return self._inv._inv_call(x)

    def log_abs_det_jacobian(self, x, y):
        return -self._inv.log_abs_det_jacobian(y, x)

    def __eq__(self, other):
        return isinstance(other, _InverseTransform) and self._inv == other._inv

    def __hash__(self):
        return hash(("inv", self._inv))


class ComposeTransform(Transform):
    """Applies ``parts`` in order."""

    def __init__(self, parts: Sequence[Transform], cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.parts = list(parts)

    @property
    def bijective(self):
        return all(p.bijective for p in self.parts)

    @property
    def domain(self):
        if not self.parts:
            return constraints.real
        return self.parts[0].domain

    @property
    def codomain(self):
        if not self.parts:
            return constraints.real
        return self.parts[-1].codomain

    def forward_shape(self, shape):
        for p in self.parts:
            shape = p.forward_shape(shape)
        return shape

    def inverse_shape(self, shape):
        for p in reversed(self.parts):
            shape = p.inverse_shape(shape)
        return shape

    @property
    def sign(self):
        s = 1
        for p in self.parts:
            s *= p.sign
        return s

    def _call(self, x):
        for p in self.parts:
            x = p(x)
        return x

    def _inverse(self, y):
        for p in reversed(self.parts):
            y = p.inv(y)
        return y

    @property
    def inv(self):
        return ComposeTransform([p.inv for p in reversed(self.parts)])

    def log_abs_det_jacobian(self, x, y):
        if not self.parts:
            return tf.zeros_like(x)
        event_dim = max([p.domain.event_dim for p in self.parts] + [0])
        total = 0.0
        for p in self.parts:
            y_p = p(x)
            total = total + _sum_rightmost(p.log_abs_det_jacobian(x, y_p), event_dim - p.domain.event_dim)
            x = y_p
        return total

    def __eq__(self, other):
        return isinstance(other, ComposeTransform) and self.parts == other.parts

    def __hash__(self):
        return hash(tuple(self.parts))


identity_transform = ComposeTransform([])


class ExpTransform(_Stateless, Transform):
    """y = exp(x)."""

    bijective = True
    codomain = constraints.positive
    sign = 1

    def _call(self, x):
        return tf.exp(x)

    def _inverse(self, y):
        return tf.math.log(y)

    def log_abs_det_jacobian(self, x, y):
        return tf.convert_to_tensor(x)


class AffineTransform(Transform):
    """y = loc + scale * x (``event_dim`` trailing dims form one event)."""

    bijective = True

    def __init__(self, loc, scale, event_dim: int = 0, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.loc, self.scale, self._event_dim = loc, scale, event_dim

    @property
    def domain(self):
        return constraints.independent(constraints.real, self._event_dim) if self._event_dim else constraints.real

    codomain = domain

    @property
    def sign(self):
        return tf.sign(self.scale)

    def _call(self, x):
        return self.loc + self.scale * x

    def _inverse(self, y):
        return (y - self.loc) / self.scale

    def log_abs_det_jacobian(self, x, y):
        result = tf.broadcast_to(tf.math.log(tf.abs(tf.cast(self.scale, tf.convert_to_tensor(x).dtype))),
                                 tf.shape(x))
        return _sum_rightmost(result, self._event_dim)

    def __eq__(self, other):
        return (isinstance(other, AffineTransform) and _same_values(self.loc, other.loc)
                and _same_values(self.scale, other.scale))

    def __hash__(self):
        return hash(AffineTransform)


class SigmoidTransform(_Stateless, Transform):
    """y = sigmoid(x)."""

    bijective = True
    codomain = constraints.unit_interval
    sign = 1

    def _call(self, x):
        return tf.sigmoid(x)

    def _inverse(self, y):
        y = tf.clip_by_value(y, 1e-7, 1 - 1e-7) if y.dtype == tf.float32 else y
        return tf.math.log(y) - tf.math.log1p(-y)

    def log_abs_det_jacobian(self, x, y):
        return -tf.nn.softplus(-x) - tf.nn.softplus(x)


class TanhTransform(_Stateless, Transform):
    """y = tanh(x)."""

    bijective = True
    codomain = constraints.interval(-1.0, 1.0)
    sign = 1

    def _call(self, x):
        return tf.tanh(x)

    def _inverse(self, y):
        return tf.atanh(y)

    def log_abs_det_jacobian(self, x, y):
        # log(1 - tanh(x)^2), stably
        return 2.0 * (math.log(2.0) - x - tf.nn.softplus(-2.0 * x))


class SoftplusTransform(_Stateless, Transform):
    """y = log(1 + exp(x))."""

    bijective = True
    codomain = constraints.positive
    sign = 1

    def _call(self, x):
        return tf.nn.softplus(x)

    def _inverse(self, y):
        return y + tf.math.log(-tf.math.expm1(-y))

    def log_abs_det_jacobian(self, x, y):
        return -tf.nn.softplus(-x)


class PowerTransform(Transform):
    """y = x ** exponent on positive reals."""

    bijective = True
    domain = constraints.positive
    codomain = constraints.positive

    def __init__(self, exponent, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.exponent = exponent

    @property
    def sign(self):
        return tf.sign(self.exponent)

    def _call(self, x):
        return tf.pow(x, self.exponent)

    def _inverse(self, y):
        return tf.pow(y, 1.0 / self.exponent)

    def log_abs_det_jacobian(self, x, y):
        return tf.math.log(tf.abs(self.exponent * y / x))

    def __eq__(self, other):
        return isinstance(other, PowerTransform) and _same_values(self.exponent, other.exponent)

    def __hash__(self):
        return hash(PowerTransform)


class AbsTransform(_Stateless, Transform):
    """y = |x| (not bijective; ``inv`` gives the positive root)."""

    codomain = constraints.positive

    def _call(self, x):
        return tf.abs(x)

    def _inverse(self, y):
        return y


class IndependentTransform(Transform):
    """Treats ``reinterpreted_batch_ndims`` more trailing dims as one event."""

    def __init__(self, base_transform: Transform, reinterpreted_batch_ndims: int, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.base_transform, self.reinterpreted_batch_ndims = base_transform, reinterpreted_batch_ndims

    @property
    def domain(self):
        return constraints.independent(self.base_transform.domain, self.reinterpreted_batch_ndims)

    @property
    def codomain(self):
        return constraints.independent(self.base_transform.codomain, self.reinterpreted_batch_ndims)

    @property
    def bijective(self):
        return self.base_transform.bijective

    @property
    def sign(self):
        return self.base_transform.sign

    def _call(self, x):
        return self.base_transform(x)

    def _inverse(self, y):
        return self.base_transform.inv(y)

    def log_abs_det_jacobian(self, x, y):
        return _sum_rightmost(self.base_transform.log_abs_det_jacobian(x, y), self.reinterpreted_batch_ndims)


class ReshapeTransform(Transform):
    """Reshapes the right-most ``in_shape`` dims to ``out_shape`` (volume preserving)."""

    bijective = True
    sign = 1

    def __init__(self, in_shape, out_shape, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        if math.prod(self.in_shape) != math.prod(self.out_shape):
            raise ValueError(f"in_shape {self.in_shape} and out_shape {self.out_shape} have different sizes")

    @property
    def domain(self):
        return constraints.independent(constraints.real, len(self.in_shape))

    @property
    def codomain(self):
        return constraints.independent(constraints.real, len(self.out_shape))

    def _call(self, x):
        batch = tf.shape(x)[: tf.rank(x) - len(self.in_shape)]
        return tf.reshape(x, tf.concat([batch, self.out_shape], 0))

    def _inverse(self, y):
        batch = tf.shape(y)[: tf.rank(y) - len(self.out_shape)]
        return tf.reshape(y, tf.concat([batch, self.in_shape], 0))

    def log_abs_det_jacobian(self, x, y):
        batch = tf.shape(x)[: tf.rank(x) - len(self.in_shape)]
        return tf.zeros(batch, dtype=tf.convert_to_tensor(x).dtype)

    def forward_shape(self, shape):
        return tuple(shape[: len(shape) - len(self.in_shape)]) + self.out_shape

    def inverse_shape(self, shape):
        return tuple(shape[: len(shape) - len(self.out_shape)]) + self.in_shape


class SoftmaxTransform(_Stateless, Transform):
    """Unconstrained vector -> simplex by softmax (not bijective)."""

    domain = constraints.real_vector
    codomain = constraints.simplex

    def _call(self, x):
        return tf.nn.softmax(x, axis=-1)

    def _inverse(self, y):
        return tf.math.log(y)


class StickBreakingTransform(_Stateless, Transform):
    """R^{K-1} -> the K-simplex by stick breaking (bijective)."""

    bijective = True
    domain = constraints.real_vector
    codomain = constraints.simplex

    def _offset(self, x):
        k = tf.cast(tf.shape(x)[-1], x.dtype)
        return k - tf.cumsum(tf.ones_like(x), axis=-1) + 1.0  # K, K-1, ..., 1 ... offset = K - i

    def _call(self, x):
        z = tf.sigmoid(x - tf.math.log(self._offset(x)))
        z_cumprod = tf.math.cumprod(1 - z, axis=-1)
        pad = tf.ones_like(z[..., :1])
        return tf.concat([z, pad], -1) * tf.concat([pad, z_cumprod], -1)

    def _inverse(self, y):
        y_crop = y[..., :-1]
        offset = self._offset(y_crop)
        sf = 1 - tf.cumsum(y_crop, axis=-1)
        sf = tf.maximum(sf, tf.experimental.numpy.finfo(y.dtype.as_numpy_dtype).tiny)
        return tf.math.log(y_crop) - tf.math.log(sf) + tf.math.log(offset)

    def log_abs_det_jacobian(self, x, y):
        x = x - tf.math.log(self._offset(x))
        return tf.reduce_sum(-x + tf.math.log_sigmoid(x) + tf.math.log(y[..., :-1]), axis=-1)

    def forward_shape(self, shape):
        return tuple(shape[:-1]) + (shape[-1] + 1,)

    def inverse_shape(self, shape):
        return tuple(shape[:-1]) + (shape[-1] - 1,)


class LowerCholeskyTransform(_Stateless, Transform):
    """Unconstrained matrix -> lower-triangular with positive diagonal (not bijective)."""

    domain = constraints.independent(constraints.real, 2)
    codomain = constraints.lower_cholesky

    def _call(self, x):
        strict = tf.linalg.band_part(x, -1, 0) - tf.linalg.diag(tf.linalg.diag_part(x))
        return strict + tf.linalg.diag(tf.exp(tf.linalg.diag_part(x)))

    def _inverse(self, y):
        strict = tf.linalg.band_part(y, -1, 0) - tf.linalg.diag(tf.linalg.diag_part(y))
        return strict + tf.linalg.diag(tf.math.log(tf.linalg.diag_part(y)))


class CumulativeDistributionTransform(Transform):
    """y = distribution.cdf(x): maps the distribution's support to the unit interval."""

    bijective = True
    codomain = constraints.unit_interval
    sign = 1

    def __init__(self, distribution, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.distribution = distribution

    @property
    def domain(self):
        return self.distribution.support

    def _call(self, x):
        return self.distribution.cdf(x)

    def _inverse(self, y):
        return self.distribution.icdf(y)

    def log_abs_det_jacobian(self, x, y):
        return self.distribution.log_prob(x)


class CorrCholeskyTransform(_Stateless, Transform):
    """R^{D(D-1)/2} -> Cholesky factors of D x D correlation matrices (bijective).

    Each unconstrained value goes through tanh to a partial correlation in
    (-1, 1); row i of the factor is built by stick breaking on the unit sphere.
    """

    bijective = True
    domain = constraints.real_vector
    codomain = constraints.corr_cholesky

    @staticmethod
    def _dim(n: int) -> int:
        d = int(round((0.25 + 2 * n) ** 0.5 + 0.5))
        if d * (d - 1) // 2 != n:
            raise ValueError(f"the input's last dim ({n}) must be D*(D-1)/2 for some D")
        return d

    def _call(self, x):
        z = tf.tanh(x)
        d = self._dim(x.shape[-1])
        rows = [tf.concat([tf.ones_like(z[..., :1])] + [tf.zeros_like(z[..., :1])] * (d - 1), -1)]
        k = 0
        for i in range(1, d):
            zi = z[..., k:k + i]
            k += i
            # x_ij = z_ij * sqrt(1 - sum_{l<j} x_il^2), last entry closes the unit norm
            entries, remaining = [], tf.ones_like(zi[..., 0])
            for j in range(i):
                entries.append(zi[..., j] * tf.sqrt(remaining))
                remaining = remaining - entries[-1] ** 2
            entries.append(tf.sqrt(tf.maximum(remaining, 0.0)))
            entries += [tf.zeros_like(zi[..., 0])] * (d - i - 1)
            rows.append(tf.stack(entries, -1))
        return tf.stack(rows, -2)

    def _inverse(self, y):
        d = y.shape[-1]
        out = []
        for i in range(1, d):
            remaining = tf.ones_like(y[..., i, 0])
            for j in range(i):
                out.append(y[..., i, j] / tf.sqrt(remaining))
                remaining = remaining - y[..., i, j] ** 2
        z = tf.stack(out, -1)
        return tf.atanh(tf.clip_by_value(z, -1 + 1e-7, 1 - 1e-7) if z.dtype == tf.float32 else z)

    def log_abs_det_jacobian(self, x, y):
        # tanh part: sum log(1 - z^2); stick breaking part: sum_{i,j} 0.5 * log(remaining_ij)
        z = tf.tanh(x)
        total = tf.reduce_sum(tf.math.log1p(-z ** 2), -1)
        d = y.shape[-1]
        for i in range(1, d):
            remaining = tf.ones_like(y[..., i, 0])
            for j in range(i):
                total = total + 0.5 * tf.math.log(remaining)
                remaining = remaining - y[..., i, j] ** 2
        return total

    def forward_shape(self, shape):
        return tuple(shape[:-1]) + (self._dim(shape[-1]),) * 2

    def inverse_shape(self, shape):
        return tuple(shape[:-2]) + (shape[-1] * (shape[-1] - 1) // 2,)


class PositiveDefiniteTransform(_Stateless, Transform):
    """Unconstrained matrix -> positive definite matrix (L L^T of its lower Cholesky image)."""

    domain = constraints.independent(constraints.real, 2)
    codomain = constraints.positive_definite

    def _call(self, x):
        chol = LowerCholeskyTransform()(x)
        return tf.matmul(chol, chol, transpose_b=True)

    def _inverse(self, y):
        return LowerCholeskyTransform().inv(tf.linalg.cholesky(y))


class CatTransform(Transform):
    """Applies ``tseq[i]`` to the ``i``-th slice (of ``lengths[i]``) along ``dim``."""

    def __init__(self, tseq, dim: int = 0, lengths=None, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.transforms, self.dim = list(tseq), dim
        self.lengths = list(lengths) if lengths is not None else [1] * len(self.transforms)

    @property
    def bijective(self):
        return all(t.bijective for t in self.transforms)

    @property
    def domain(self):
        return constraints.cat([t.domain for t in self.transforms], self.dim, self.lengths)

    @property
    def codomain(self):
        return constraints.cat([t.codomain for t in self.transforms], self.dim, self.lengths)

    def _split(self, x):
        return tf.split(x, self.lengths, axis=self.dim)

    def _call(self, x):
        return tf.concat([t(p) for t, p in zip(self.transforms, self._split(x))], axis=self.dim)

    def _inverse(self, y):
        return tf.concat([t.inv(p) for t, p in zip(self.transforms, self._split(y))], axis=self.dim)

    def log_abs_det_jacobian(self, x, y):
        parts = [t.log_abs_det_jacobian(a, b) for t, a, b in zip(self.transforms, self._split(x), self._split(y))]
        return tf.concat(parts, axis=self.dim)


class StackTransform(Transform):
    """Applies ``tseq[i]`` to slice ``i`` of ``dim``."""

    def __init__(self, tseq, dim: int = 0, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.transforms, self.dim = list(tseq), dim

    @property
    def bijective(self):
        return all(t.bijective for t in self.transforms)

    @property
    def domain(self):
        return constraints.stack([t.domain for t in self.transforms], self.dim)

    @property
    def codomain(self):
        return constraints.stack([t.codomain for t in self.transforms], self.dim)

    def _call(self, x):
        return tf.stack([t(p) for t, p in zip(self.transforms, tf.unstack(x, axis=self.dim))], axis=self.dim)

    def _inverse(self, y):
        return tf.stack([t.inv(p) for t, p in zip(self.transforms, tf.unstack(y, axis=self.dim))], axis=self.dim)

    def log_abs_det_jacobian(self, x, y):
        parts = [t.log_abs_det_jacobian(a, b) for t, a, b in
                 zip(self.transforms, tf.unstack(x, axis=self.dim), tf.unstack(y, axis=self.dim))]
        return tf.stack(parts, axis=self.dim)


__all__ += ["CorrCholeskyTransform", "PositiveDefiniteTransform", "CatTransform", "StackTransform"]
