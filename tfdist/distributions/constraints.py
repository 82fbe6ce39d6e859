"""Constraints: the support of a distribution or the domain of a parameter.

``constraint.check(value)`` returns a boolean tensor (one entry per event,
i.e. reduced over ``event_dim`` trailing dims).
"""

from __future__ import annotations

import tensorflow as tf

__all__ = [
    "Constraint", "boolean", "real", "real_vector", "positive", "nonnegative", "unit_interval",
    "interval", "half_open_interval", "greater_than", "greater_than_eq", "less_than",
    "integer_interval", "nonnegative_integer", "positive_integer", "simplex", "independent",
    "lower_triangular", "lower_cholesky", "positive_definite", "positive_semidefinite", "dependent",
    "is_dependent",
]


class Constraint:
    """Base class: ``check(value)`` says which values satisfy the constraint."""

    is_discrete = False
    event_dim = 0

    def check(self, value):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__.lstrip("_") + "()"


class _Dependent(Constraint):
    """A placeholder for supports that depend on other parameters."""

    def check(self, value):
        raise ValueError("cannot determine validity of a dependent constraint")


def is_dependent(constraint) -> bool:
    return isinstance(constraint, _Dependent)


class _Boolean(Constraint):
    is_discrete = True

    def check(self, value):
        return tf.logical_or(tf.equal(value, 0), tf.equal(value, 1))


class _Real(Constraint):
    def check(self, value):
        return tf.equal(value, value)  # False for NaN


class _GreaterThan(Constraint):
    def __init__(self, lower_bound):
        self.lower_bound = lower_bound

    def check(self, value):
        return tf.greater(value, self.lower_bound)

    def __repr__(self):
        return f"GreaterThan(lower_bound={self.lower_bound})"


class _GreaterThanEq(_GreaterThan):
    def check(self, value):
        return tf.greater_equal(value, self.lower_bound)

    def __repr__(self):
        return f"GreaterThanEq(lower_bound={self.lower_bound})"


class _LessThan(Constraint):
    def __init__(self, upper_bound):
        self.upper_bound = upper_bound

    def check(self, value):
        return tf.less(value, self.upper_bound)


class _Interval(Constraint):
    def __init__(self, lower_bound, upper_bound):
        self.lower_bound, self.upper_bound = lower_bound, upper_bound

    def check(self, value):
        return tf.logical_and(tf.greater_equal(value, self.lower_bound), tf.less_equal(value, self.upper_bound))

    def __repr__(self):
        return f"{type(self).__name__.lstrip('_')}(lower_bound={self.lower_bound}, upper_bound={self.upper_bound})"


class _HalfOpenInterval(_Interval):
    def check(self, value):
        return tf.logical_and(tf.greater_equal(value, self.lower_bound), tf.less(value, self.upper_bound))


def _is_integer(value):
    """torch's ``value % 1 == 0``: false for infinities and NaN, true for any finite float that is whole."""
    value = tf.convert_to_tensor(value)
    if value.dtype.is_integer:
        return tf.ones_like(value, tf.bool)
    return tf.equal(tf.math.floormod(value, tf.ones_like(value)), 0)


class _IntegerInterval(_Interval):
    is_discrete = True

    def check(self, value):
        return tf.logical_and(_is_integer(value), super().check(value))


class _IntegerGreaterThan(_GreaterThanEq):
    is_discrete = True

    def check(self, value):
        return tf.logical_and(_is_integer(value), super().check(value))

    def __repr__(self):
        return f"IntegerGreaterThan(lower_bound={self.lower_bound})"


class _Independent(Constraint):
    """Reinterprets ``n`` batch dims of a constraint as event dims."""

    def __init__(self, base: Constraint, reinterpreted_batch_ndims: int):
        self.base_constraint, self.reinterpreted_batch_ndims = base, reinterpreted_batch_ndims

    @property
    def is_discrete(self):
        return self.base_constraint.is_discrete

    @property
    def event_dim(self):
        return self.base_constraint.event_dim + self.reinterpreted_batch_ndims

    def __repr__(self):
        return f"IndependentConstraint({self.base_constraint!r}, {self.reinterpreted_batch_ndims})"

    def check(self, value):
        ok = self.base_constraint.check(value)
        if self.reinterpreted_batch_ndims:
            ok = tf.reduce_all(ok, axis=list(range(-self.reinterpreted_batch_ndims, 0)))
        return ok


class _Simplex(Constraint):
    event_dim = 1

    def check(self, value):
        return tf.logical_and(tf.reduce_all(value >= 0, axis=-1),
                              tf.abs(tf.reduce_sum(value, axis=-1) - 1) < 1e-6)


class _LowerTriangular(Constraint):
    event_dim = 2

    def check(self, value):
        return tf.reduce_all(tf.equal(tf.linalg.band_part(value, -1, 0), value), axis=[-2, -1])


class _LowerCholesky(_LowerTriangular):
    def check(self, value):
        diag = tf.linalg.diag_part(value)
        return tf.logical_and(super().check(value), tf.reduce_all(diag > 0, axis=-1))


def _is_symmetric(value):
    """torch's ``isclose(value, value.mT, atol=1e-6).all()`` per matrix (rtol 1e-5, as torch's default)."""
    value = tf.convert_to_tensor(value)
    other = tf.linalg.matrix_transpose(value)
    close = tf.abs(value - other) <= 1e-6 + 1e-5 * tf.abs(other)
    return tf.reduce_all(close, axis=[-2, -1])


class _PositiveDefinite(Constraint):
    """Symmetric with every eigenvalue > 0 (torch: a Cholesky factorisation exists), per matrix."""

    event_dim = 2

    def check(self, value):
        value = tf.convert_to_tensor(value)
        return tf.logical_and(_is_symmetric(value), tf.reduce_all(tf.linalg.eigvalsh(value) > 0, axis=-1))


class _PositiveSemidefinite(Constraint):
    """Symmetric with every eigenvalue >= 0, per matrix."""

    event_dim = 2

    def check(self, value):
        value = tf.convert_to_tensor(value)
        return tf.logical_and(_is_symmetric(value), tf.reduce_all(tf.linalg.eigvalsh(value) >= 0, axis=-1))


dependent = _Dependent()
boolean = _Boolean()
real = _Real()
real_vector = _Independent(real, 1)
positive = _GreaterThan(0.0)
nonnegative = _GreaterThanEq(0.0)
unit_interval = _Interval(0.0, 1.0)
nonnegative_integer = _IntegerGreaterThan(0)
positive_integer = _IntegerGreaterThan(1)
simplex = _Simplex()
lower_triangular = _LowerTriangular()
lower_cholesky = _LowerCholesky()
positive_definite = _PositiveDefinite()
positive_semidefinite = _PositiveSemidefinite()
interval = _Interval
half_open_interval = _HalfOpenInterval
greater_than = _GreaterThan
greater_than_eq = _GreaterThanEq
less_than = _LessThan
integer_interval = _IntegerInterval
independent = _Independent


class _Square(Constraint):
    event_dim = 2

    def check(self, value):
        n, m = value.shape[-2], value.shape[-1]
        return tf.fill(tf.shape(value)[:-2], n == m)


class _Symmetric(_Square):
    def check(self, value):
        if value.shape[-2] != value.shape[-1]:
            return super().check(value)
        return _is_symmetric(value)


class _CorrCholesky(Constraint):
    """Lower Cholesky factors of correlation matrices (rows of unit norm)."""

    event_dim = 2

    def check(self, value):
        unit_rows = tf.reduce_all(tf.abs(tf.norm(value, axis=-1) - 1) < 1e-4, axis=-1)
        return tf.logical_and(lower_cholesky.check(value), unit_rows)


class _OneHot(Constraint):
    is_discrete = True
    event_dim = 1

    def check(self, value):
        is_boolean = tf.reduce_all(tf.logical_or(tf.equal(value, 0), tf.equal(value, 1)), axis=-1)
        return tf.logical_and(is_boolean, tf.equal(tf.reduce_sum(value, -1), 1))


class _Multinomial(Constraint):
    is_discrete = True
    event_dim = 1

    def __init__(self, upper_bound):
        self.upper_bound = upper_bound

    def check(self, value):
        return tf.logical_and(tf.reduce_all(value >= 0, axis=-1), tf.reduce_sum(value, -1) <= self.upper_bound)


class _Cat(Constraint):
    """Applies constraints to consecutive slices of ``dim``."""

    def __init__(self, cseq, dim=0, lengths=None):
        self.cseq, self.dim = list(cseq), dim
        self.lengths = list(lengths) if lengths is not None else [1] * len(self.cseq)

    @property
    def event_dim(self):
        return max(c.event_dim for c in self.cseq)

    def check(self, value):
        parts = tf.split(value, self.lengths, axis=self.dim)
        return tf.concat([c.check(p) for c, p in zip(self.cseq, parts)], axis=self.dim)


class _Stack(Constraint):
    """Applies constraints to the slices of ``dim``."""

    def __init__(self, cseq, dim=0):
        self.cseq, self.dim = list(cseq), dim

    @property
    def event_dim(self):
        return max(c.event_dim for c in self.cseq)

    def check(self, value):
        parts = tf.unstack(value, axis=self.dim)
        return tf.stack([c.check(p) for c, p in zip(self.cseq, parts)], axis=self.dim)


class MixtureSameFamilyConstraint(Constraint):
    """The support of a MixtureSameFamily: its component's support, checked against every component."""

    def __init__(self, base_constraint: Constraint) -> None:
        if not isinstance(base_constraint, Constraint):
            raise TypeError(f"base_constraint must be a Constraint, got {type(base_constraint).__name__}")
        self.base_constraint = base_constraint

    @property
    def is_discrete(self) -> bool:
        return self.base_constraint.is_discrete

    @property
    def event_dim(self) -> int:
        return self.base_constraint.event_dim

    def check(self, value):
        value = tf.convert_to_tensor(value)
        if value.shape.rank < self.event_dim:
            raise ValueError(f"Expected value.dim() >= {self.event_dim} but got {value.shape.rank}")
        # the component dim sits just left of the event dims; a value is valid if every component accepts it
        result = self.base_constraint.check(tf.expand_dims(value, value.shape.rank - self.event_dim))
        keep = value.shape.rank - self.event_dim
        return tf.reduce_all(tf.reshape(result, tf.concat([tf.shape(result)[:keep], [-1]], 0)), -1)

    def __repr__(self) -> str:
        return f"MixtureSameFamilyConstraint({self.base_constraint!r})"


square = _Square()
symmetric = _Symmetric()
corr_cholesky = _CorrCholesky()
one_hot = _OneHot()
multinomial = _Multinomial
cat = _Cat
stack = _Stack
__all__ += ["square", "symmetric", "corr_cholesky", "one_hot", "multinomial", "cat", "stack",
            "MixtureSameFamilyConstraint"]


class _DependentProperty(property, _Dependent):
    """A property whose value is a constraint computed from the instance (e.g. a support).

    On the class it is a dependent constraint (``is_dependent`` is True); on an
    instance it returns the computed constraint.

    Example::

        @constraints.dependent_property(is_discrete=False, event_dim=0)
        def support(self):
            return constraints.interval(self.low, self.high)
    """

    def __init__(self, fn=None, *, is_discrete=False, event_dim=0):
        super().__init__(fn)
        self._is_discrete, self._event_dim = is_discrete, event_dim

    @property
    def is_discrete(self):
        return self._is_discrete

    @property
    def event_dim(self):
        return self._event_dim

    def __call__(self, fn):
        return _DependentProperty(fn, is_discrete=self._is_discrete, event_dim=self._event_dim)


dependent_property = _DependentProperty
__all__ += ["dependent_property"]
