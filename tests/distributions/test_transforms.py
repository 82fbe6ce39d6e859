"""Transforms against finite differences and closed forms; TransformedDistribution against scipy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st
import tensorflow as tf

from tfdist import distributions as D


@pytest.fixture(autouse=True)
def _seeded():
    """Sampling tests draw from TF's RNG: a fixed seed per test keeps them deterministic."""
    tf.random.set_seed(1234)
from tfdist.distributions import constraints
from tfdist.distributions import transforms as T

X = np.array([-1.5, -0.2, 0.4, 2.0])
X_POS = np.array([0.3, 1.0, 2.5])

ELEMENTWISE = [
    ("exp", T.ExpTransform(), X),
    ("affine", T.AffineTransform(1.0, -3.0), X),
    ("sigmoid", T.SigmoidTransform(), X),
    ("tanh", T.TanhTransform(), X),
    ("softplus", T.SoftplusTransform(), X),
    ("power", T.PowerTransform(2.5), X_POS),
]


@pytest.mark.parametrize("name, t, x", ELEMENTWISE, ids=[c[0] for c in ELEMENTWISE])
def test_elementwise_transform_jacobian_and_inverse(name, t, x):
    x64 = tf.constant(x, tf.float64)
    y = t(x64)
    np.testing.assert_allclose(t.inv(y).numpy(), x, rtol=1e-8, atol=1e-10)
    h = 1e-6
    numeric = np.log(np.abs((t(x64 + h).numpy() - t(x64 - h).numpy()) / (2 * h)))
    np.testing.assert_allclose(t.log_abs_det_jacobian(x64, y).numpy(), numeric, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t.inv.log_abs_det_jacobian(y, x64).numpy(), -numeric, rtol=1e-5, atol=1e-6)
    assert t.bijective and bool(tf.reduce_all(t.codomain.check(y)))


def test_compose_cache_and_shapes():
    t = T.ComposeTransform([T.AffineTransform(0.5, 2.0), T.ExpTransform()])
    x = tf.constant(X)
    np.testing.assert_allclose(t(x).numpy(), np.exp(0.5 + 2 * X))
    np.testing.assert_allclose(t.log_abs_det_jacobian(x, t(x)).numpy(), np.log(2.0) + 0.5 + 2 * X, rtol=1e-6)
    np.testing.assert_allclose(t.inv(t(x)).numpy(), X, rtol=1e-6)
    cached = T.ExpTransform(cache_size=1)
    y = cached(x)
    assert cached.inv(y) is x  # the cached pair comes back as it was
    with pytest.raises(ValueError, match="cache_size must be 0 or 1"):
        T.ExpTransform(cache_size=2)
    r = T.ReshapeTransform((2, 3), (6,))
    assert tuple(r(tf.zeros((4, 2, 3))).shape) == (4, 6) and r.forward_shape((4, 2, 3)) == (4, 6)
    ind = T.IndependentTransform(T.ExpTransform(), 1)
    np.testing.assert_allclose(ind.log_abs_det_jacobian(x, ind(x)).numpy(), X.sum(), rtol=1e-6)


def test_stick_breaking_and_softmax():
    t = T.StickBreakingTransform()
    x = tf.constant([[0.3, -1.0, 2.0]], tf.float64)
    y = t(x)
    assert tuple(y.shape) == (1, 4)
    np.testing.assert_allclose(y.numpy().sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(t.inv(y).numpy(), x.numpy(), rtol=1e-8)
    # log|det J| of the map to the first K-1 coordinates, by finite differences
    h = 1e-6
    jac = np.stack([(t(x + h * np.eye(3)[i]).numpy() - t(x - h * np.eye(3)[i]).numpy())[0, :3] / (2 * h)
                    for i in range(3)], axis=1)
    np.testing.assert_allclose(t.log_abs_det_jacobian(x, y).numpy()[0], np.log(abs(np.linalg.det(jac))), rtol=1e-5)
    s = T.SoftmaxTransform()
    np.testing.assert_allclose(s(x).numpy().sum(), 1.0, rtol=1e-12)
    assert not s.bijective


def test_transformed_distribution_against_scipy():
    log_normal = D.TransformedDistribution(D.Normal(0.2, 0.7), [T.ExpTransform()])
    ref = st.lognorm(s=0.7, scale=np.exp(0.2))
    np.testing.assert_allclose(log_normal.log_prob(tf.constant(X_POS, tf.float32)).numpy(), ref.logpdf(X_POS), rtol=1e-5)
    np.testing.assert_allclose(log_normal.cdf(tf.constant(X_POS, tf.float32)).numpy(), ref.cdf(X_POS), rtol=1e-5)
    assert log_normal.has_rsample and st.kstest(log_normal.sample((4000,)).numpy(), ref.cdf).pvalue > 1e-4
    flipped = D.TransformedDistribution(D.Exponential(2.0), T.AffineTransform(1.0, -1.0))  # y = 1 - x
    ref = st.expon(scale=0.5)
    y = np.array([0.5, -1.0])
    np.testing.assert_allclose(flipped.log_prob(tf.constant(y, tf.float32)).numpy(), ref.logpdf(1 - y), rtol=1e-5)
    np.testing.assert_allclose(flipped.cdf(tf.constant(y, tf.float32)).numpy(), 1 - ref.cdf(1 - y), rtol=1e-5)
    vec = D.TransformedDistribution(D.Normal(tf.zeros(3), tf.ones(3)), [T.IndependentTransform(T.ExpTransform(), 1)])
    assert tuple(vec.event_shape) == (3,) and tuple(vec.batch_shape) == ()
    np.testing.assert_allclose(float(vec.log_prob(tf.constant(X_POS, tf.float32))),
                               st.lognorm(s=1.0).logpdf(X_POS).sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="transforms must be a Transform"):
        D.TransformedDistribution(D.Normal(0.0, 1.0), [lambda v: v])


@pytest.mark.parametrize("constraint", [
    constraints.real, constraints.positive, constraints.greater_than(2.0), constraints.unit_interval,
    constraints.interval(-1.0, 3.0), constraints.less_than(1.0), constraints.simplex,
    constraints.stack([constraints.positive, constraints.unit_interval, constraints.real], dim=1),
], ids=repr)
def test_biject_to_lands_in_the_constraint(constraint):
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 3)) * 3)
    for registry in (D.biject_to, D.transform_to):
        t = registry(constraint)
        y = t(x)
        assert bool(tf.reduce_all(constraint.check(y))), (registry, constraint)
        if registry is D.biject_to and t.bijective:
            np.testing.assert_allclose(t.inv(y).numpy(), x.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="Cannot transform"):
        D.biject_to(constraints.positive_definite)
    corr = D.biject_to(constraints.corr_cholesky)(tf.constant(np.ones((2, 3))))
    assert bool(tf.reduce_all(constraints.corr_cholesky.check(corr)))


def test_corr_cholesky_transform():
    t = T.CorrCholeskyTransform()
    x = tf.constant([[0.3, -1.0, 0.7]], tf.float64)  # D = 3
    y = t(x)
    assert tuple(y.shape) == (1, 3, 3)
    corr = (y @ tf.linalg.matrix_transpose(y)).numpy()
    np.testing.assert_allclose(np.diagonal(corr, axis1=-2, axis2=-1), 1.0, rtol=1e-12)
    assert bool(tf.reduce_all(constraints.corr_cholesky.check(y)))
    np.testing.assert_allclose(t.inv(y).numpy(), x.numpy(), rtol=1e-8)
    # log|det J| of x -> the strictly lower entries, by finite differences
    h, idx = 1e-6, [(1, 0), (2, 0), (2, 1)]

    def lower(v):
        m = t(tf.constant(v)).numpy()[0]
        return np.array([m[i, j] for i, j in idx])

    jac = np.stack([(lower(x.numpy() + h * np.eye(3)[k]) - lower(x.numpy() - h * np.eye(3)[k])) / (2 * h)
                    for k in range(3)], axis=1)
    np.testing.assert_allclose(t.log_abs_det_jacobian(x, y).numpy()[0], np.log(abs(np.linalg.det(jac))), rtol=1e-5)


def test_cat_stack_and_positive_definite():
    x = tf.constant([[-1.0, 0.5, 2.0, 0.1]], tf.float64)
    cat = T.CatTransform([T.ExpTransform(), T.AffineTransform(1.0, 2.0)], dim=1, lengths=[2, 2])
    y = cat(x)
    np.testing.assert_allclose(y.numpy(), [[np.exp(-1.0), np.exp(0.5), 5.0, 1.2]], rtol=1e-12)
    np.testing.assert_allclose(cat.inv(y).numpy(), x.numpy(), rtol=1e-12)
    np.testing.assert_allclose(cat.log_abs_det_jacobian(x, y).numpy(), [[-1.0, 0.5, np.log(2), np.log(2)]], rtol=1e-12)
    stack = T.StackTransform([T.ExpTransform(), T.SigmoidTransform()], dim=1)
    z = tf.constant([[0.5, -0.5]], tf.float64)
    np.testing.assert_allclose(stack(z).numpy(), [[np.exp(0.5), 1 / (1 + np.exp(0.5))]], rtol=1e-12)
    assert bool(tf.reduce_all(stack.codomain.check(stack(z))))
    pd = T.PositiveDefiniteTransform()(tf.constant(np.random.default_rng(0).standard_normal((2, 3, 3))))
    assert bool(tf.reduce_all(constraints.positive_definite.check(pd)))
    assert bool(tf.reduce_all(constraints.symmetric.check(pd))) and bool(tf.reduce_all(constraints.square.check(pd)))
    assert bool(constraints.one_hot.check(tf.constant([0.0, 1.0, 0.0])))
    assert not bool(constraints.multinomial(3).check(tf.constant([2.0, 2.0])))


def test_dependent_property_supports():
    assert constraints.is_dependent(D.Uniform.support)
    support = D.Uniform(-1.0, 2.0).support
    assert not constraints.is_dependent(support) and support.lower_bound.numpy() == -1.0
    assert bool(D.Pareto(2.0, 3.0).support.check(tf.constant(2.5)))
    assert not bool(D.Pareto(2.0, 3.0).support.check(tf.constant(1.5)))
