"""tfdist.distributions against scipy, closed forms and Monte Carlo (never against TFP)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.stats as st
import tensorflow as tf

from tfdist import distributions as D


@pytest.fixture(autouse=True)
def _seeded():
    """Sampling tests draw from TF's RNG: a fixed seed per test keeps them deterministic."""
    tf.random.set_seed(1234)

X_POS = np.array([0.3, 1.0, 2.5])
X_UNIT = np.array([0.1, 0.5, 0.8])
X_REAL = np.array([-1.2, 0.0, 2.0])

CONTINUOUS = [
    ("Normal", lambda: D.Normal(0.5, 2.0), st.norm(0.5, 2.0), X_REAL, True),
    ("LogNormal", lambda: D.LogNormal(0.2, 0.7), st.lognorm(s=0.7, scale=np.exp(0.2)), X_POS, True),
    ("Laplace", lambda: D.Laplace(0.5, 2.0), st.laplace(0.5, 2.0), X_REAL, True),
    ("Cauchy", lambda: D.Cauchy(0.5, 2.0), st.cauchy(0.5, 2.0), X_REAL, False),
    ("Gumbel", lambda: D.Gumbel(0.5, 2.0), st.gumbel_r(0.5, 2.0), X_REAL, True),
    ("HalfNormal", lambda: D.HalfNormal(1.5), st.halfnorm(scale=1.5), X_POS, True),
    ("HalfCauchy", lambda: D.HalfCauchy(1.5), st.halfcauchy(scale=1.5), X_POS, False),
    ("Exponential", lambda: D.Exponential(2.0), st.expon(scale=0.5), X_POS, True),
    ("Gamma", lambda: D.Gamma(2.5, 1.5), st.gamma(a=2.5, scale=1 / 1.5), X_POS, True),
    ("Chi2", lambda: D.Chi2(3.0), st.chi2(3.0), X_POS, True),
    ("Beta", lambda: D.Beta(2.0, 3.0), st.beta(2.0, 3.0), X_UNIT, True),
    ("Uniform", lambda: D.Uniform(-1.0, 3.0), st.uniform(-1.0, 4.0), np.array([-0.5, 0.0, 2.9]), True),
    ("StudentT", lambda: D.StudentT(5.0, 0.5, 2.0), st.t(5.0, 0.5, 2.0), X_REAL, True),
    ("Pareto", lambda: D.Pareto(2.0, 3.0), st.pareto(b=3.0, scale=2.0), np.array([2.1, 3.0, 5.0]), True),
    ("Weibull", lambda: D.Weibull(2.0, 1.5), st.weibull_min(c=1.5, scale=2.0), X_POS, True),
]


@pytest.mark.parametrize("name, make, ref, x, has_moments", CONTINUOUS, ids=[c[0] for c in CONTINUOUS])
def test_continuous_against_scipy(name, make, ref, x, has_moments):
    dist = make()
    np.testing.assert_allclose(dist.log_prob(tf.constant(x, tf.float32)).numpy(), ref.logpdf(x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dist.cdf(tf.constant(x, tf.float32)).numpy(), ref.cdf(x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(dist.entropy()), ref.entropy(), rtol=1e-4)
    if has_moments:
        np.testing.assert_allclose(float(dist.mean), ref.mean(), rtol=1e-4)
        np.testing.assert_allclose(float(dist.variance), ref.var(), rtol=1e-4)
        np.testing.assert_allclose(float(dist.stddev), ref.std(), rtol=1e-4)
    assert dist.has_rsample
    samples = dist.sample((4000,)).numpy()
    assert samples.shape == (4000,)
    assert st.kstest(samples, ref.cdf).pvalue > 1e-4


DISCRETE = [
    ("Bernoulli", lambda: D.Bernoulli(probs=0.3), st.bernoulli(0.3), np.array([0.0, 1.0, 1.0])),
    ("Bernoulli-logits", lambda: D.Bernoulli(logits=np.log(0.3 / 0.7)), st.bernoulli(0.3), np.array([0.0, 1.0])),
    ("Geometric", lambda: D.Geometric(probs=0.3), st.geom(0.3, loc=-1), np.array([0.0, 1.0, 4.0])),
    ("Poisson", lambda: D.Poisson(2.5), st.poisson(2.5), np.array([0.0, 2.0, 7.0])),
    ("Binomial", lambda: D.Binomial(10.0, probs=0.3), st.binom(10, 0.3), np.array([0.0, 3.0, 10.0])),
]


@pytest.mark.parametrize("name, make, ref, x", DISCRETE, ids=[c[0] for c in DISCRETE])
def test_discrete_against_scipy(name, make, ref, x):
    dist = make()
    np.testing.assert_allclose(dist.log_prob(tf.constant(x, tf.float32)).numpy(), ref.logpmf(x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(dist.mean), ref.mean(), rtol=1e-4)
    np.testing.assert_allclose(float(dist.variance), ref.var(), rtol=1e-4)
    assert not dist.has_rsample
    with pytest.raises(NotImplementedError):
        dist.rsample()
    samples = dist.sample((20000,)).numpy()
    np.testing.assert_allclose(samples.mean(), ref.mean(), atol=4 * ref.std() / np.sqrt(20000))


def test_categorical_and_enumerate_support():
    probs = np.array([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]], np.float32)
    dist = D.Categorical(probs=probs)
    assert tuple(dist.batch_shape) == (2,) and tuple(dist.event_shape) == ()
    np.testing.assert_allclose(dist.log_prob(tf.constant([2, 0])).numpy(), np.log([0.5, 0.6]), rtol=1e-5)
    np.testing.assert_allclose(dist.entropy().numpy(), -(probs * np.log(probs)).sum(1), rtol=1e-5)
    support = dist.enumerate_support()
    assert tuple(support.shape) == (3, 2) and support.numpy()[:, 0].tolist() == [0, 1, 2]
    assert tuple(dist.enumerate_support(expand=False).shape) == (3, 1)
    np.testing.assert_allclose(D.Categorical(logits=np.log(probs)).probs.numpy(), probs, rtol=1e-5)
    assert tuple(D.Bernoulli(probs=[0.1, 0.9]).enumerate_support().shape) == (2, 2)
    counts = np.bincount(dist.sample((30000,)).numpy()[:, 0], minlength=3) / 30000
    np.testing.assert_allclose(counts, probs[0], atol=0.02)


def test_dirichlet_and_multivariate_normal_against_scipy():
    alpha = np.array([1.5, 2.0, 3.0])
    x = np.array([0.2, 0.3, 0.5])
    dirichlet = D.Dirichlet(alpha)
    ref = st.dirichlet(alpha)
    np.testing.assert_allclose(float(dirichlet.log_prob(x)), ref.logpdf(x), rtol=1e-4)
    np.testing.assert_allclose(dirichlet.mean.numpy(), ref.mean(), rtol=1e-5)
    np.testing.assert_allclose(dirichlet.variance.numpy(), ref.var(), rtol=1e-4)
    assert tuple(dirichlet.event_shape) == (3,) and tuple(dirichlet.sample((5,)).shape) == (5, 3)

    cov = np.array([[2.0, 0.3], [0.3, 1.0]])
    loc = np.array([0.5, -1.0])
    ref = st.multivariate_normal(loc, cov)
    v = np.array([[0.0, 0.0], [1.0, -2.0]])
    for kwargs in ({"covariance_matrix": cov}, {"precision_matrix": np.linalg.inv(cov)},
                   {"scale_tril": np.linalg.cholesky(cov)}):
        mvn = D.MultivariateNormal(tf.constant(loc, tf.float64), **{k: tf.constant(m) for k, m in kwargs.items()})
        np.testing.assert_allclose(mvn.log_prob(v).numpy(), ref.logpdf(v), rtol=1e-8)
        np.testing.assert_allclose(float(mvn.entropy()), ref.entropy(), rtol=1e-8)
        np.testing.assert_allclose(mvn.covariance_matrix.numpy(), cov, rtol=1e-8)
    with pytest.raises(ValueError, match="Exactly one of covariance_matrix"):
        D.MultivariateNormal(loc, covariance_matrix=cov, scale_tril=np.linalg.cholesky(cov))


def test_independent_and_expand():
    base = D.Normal(tf.zeros((3, 4)), tf.ones((3, 4)))
    ind = D.Independent(base, 1)
    assert tuple(ind.batch_shape) == (3,) and tuple(ind.event_shape) == (4,)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(ind.log_prob(x).numpy(), st.norm.logpdf(x).sum(1), rtol=1e-5)
    wide = D.Normal(0.0, 1.0).expand((2, 5))
    assert tuple(wide.batch_shape) == (2, 5) and tuple(wide.sample((3,)).shape) == (3, 2, 5)
    with pytest.raises(ValueError, match="reinterpreted_batch_ndims"):
        D.Independent(base, 3)


def _kl_normal(m1, s1, m2, s2):
    return np.log(s2 / s1) + (s1 ** 2 + (m1 - m2) ** 2) / (2 * s2 ** 2) - 0.5


def test_kl_closed_forms():
    np.testing.assert_allclose(float(D.kl_divergence(D.Normal(0.3, 1.2), D.Normal(-0.5, 2.0))),
                               _kl_normal(0.3, 1.2, -0.5, 2.0), rtol=1e-5)
    p, q = 0.3, 0.6
    want = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    np.testing.assert_allclose(float(D.kl_divergence(D.Bernoulli(probs=p), D.Bernoulli(probs=q))), want, rtol=1e-4)
    a, b = np.array([0.2, 0.3, 0.5]), np.array([0.4, 0.4, 0.2])
    np.testing.assert_allclose(float(D.kl_divergence(D.Categorical(probs=a), D.Categorical(probs=b))),
                               (a * np.log(a / b)).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(D.kl_divergence(D.Exponential(2.0), D.Exponential(0.5))),
                               np.log(2.0 / 0.5) + 0.5 / 2.0 - 1, rtol=1e-5)
    kp, tp, kq, tq = 2.0, 1.5, 3.0, 0.5  # Gamma(concentration, rate)
    from scipy.special import digamma, gammaln
    want = ((kp - kq) * digamma(kp) - gammaln(kp) + gammaln(kq) + kq * (np.log(tp) - np.log(tq))
            + kp * (tq - tp) / tp)
    np.testing.assert_allclose(float(D.kl_divergence(D.Gamma(kp, tp), D.Gamma(kq, tq))), want, rtol=1e-4)
    np.testing.assert_allclose(float(D.kl_divergence(D.Uniform(0.0, 1.0), D.Uniform(-1.0, 2.0))), np.log(3.0), rtol=1e-6)
    assert np.isinf(float(D.kl_divergence(D.Uniform(-2.0, 1.0), D.Uniform(-1.0, 2.0))))
    c1, c2 = np.array([[2.0, 0.3], [0.3, 1.0]]), np.eye(2)
    m1, m2 = np.array([0.5, -1.0]), np.zeros(2)
    want = 0.5 * (np.trace(np.linalg.inv(c2) @ c1) + (m2 - m1) @ np.linalg.inv(c2) @ (m2 - m1) - 2
                  + np.log(np.linalg.det(c2) / np.linalg.det(c1)))
    got = D.kl_divergence(D.MultivariateNormal(m1, covariance_matrix=c1), D.MultivariateNormal(m2, covariance_matrix=c2))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    ind = D.kl_divergence(D.Independent(D.Normal(tf.zeros(3), tf.ones(3)), 1),
                          D.Independent(D.Normal(tf.ones(3), 2 * tf.ones(3)), 1))
    np.testing.assert_allclose(float(ind), 3 * _kl_normal(0, 1, 1, 2), rtol=1e-5)
    with pytest.raises(NotImplementedError, match="No KL"):
        D.kl_divergence(D.Cauchy(0.0, 1.0), D.Poisson(1.0))
    # two different exponential families reach torch's Bregman fallback, which refuses
    with pytest.raises(NotImplementedError, match="different exponential families"):
        D.kl_divergence(D.Normal(0.0, 1.0), D.Poisson(1.0))


def test_register_kl_most_specific_match_and_ambiguity():
    class A(D.Normal):
        pass

    class B(A):
        pass

    @D.register_kl(A, D.Normal)
    def kl_a_normal(p, q):
        return tf.constant(1.0)

    @D.register_kl(D.Normal, B)
    def kl_normal_b(p, q):
        return tf.constant(2.0)

    assert float(D.kl_divergence(A(0.0, 1.0), D.Normal(0.0, 1.0))) == 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = float(D.kl_divergence(A(0.0, 1.0), B(0.0, 1.0)))
    assert value == 1.0 and any("Ambiguous kl_divergence(A, B)" in str(w.message) for w in caught)
    with pytest.raises(TypeError, match="Distribution subclass"):
        D.register_kl(int, D.Normal)


def test_rsample_is_differentiable_and_graph_mode_works():
    loc = tf.Variable(0.5)
    scale = tf.Variable(2.0)
    with tf.GradientTape() as tape:
        z = D.Normal(loc, scale).rsample((20000,))
        objective = tf.reduce_mean(z)
    g_loc, g_scale = tape.gradient(objective, [loc, scale])
    np.testing.assert_allclose(float(g_loc), 1.0, rtol=1e-5)
    assert abs(float(g_scale)) < 0.05  # d E[z] / d scale = 0
    with tf.GradientTape() as tape:
        assert D.Categorical(probs=[0.5, 0.5]).sample().dtype == tf.int64
        sample = D.Bernoulli(probs=loc / 2).sample()
    assert tape.gradient(sample, loc) is None  # sample() is not differentiable

    @tf.function
    def lp(x):
        return D.Gamma(2.0, 3.0).log_prob(x)

    np.testing.assert_allclose(lp(tf.constant(0.7)).numpy(), st.gamma(2.0, scale=1 / 3).logpdf(0.7), rtol=1e-5)
    d64 = D.Normal(tf.constant(0.0, tf.float64), 1.0)
    assert d64.log_prob(0.5).dtype == tf.float64


def test_validation_errors_and_default():
    with pytest.raises(ValueError, match=r"Expected parameter scale .* to satisfy the constraint GreaterThan"):
        D.Normal(0.0, -1.0)
    with pytest.raises(ValueError, match="to be within the support"):
        D.Exponential(1.0).log_prob(-1.0)
    with pytest.raises(ValueError, match="Either `probs` or `logits` must be specified"):
        D.Bernoulli(probs=0.5, logits=0.0)
    with pytest.raises(ValueError, match="low to be less than high"):
        D.Uniform(2.0, 1.0)
    D.Normal(0.0, -1.0, validate_args=False)  # no check when asked
    D.Distribution.set_default_validate_args(False)
    try:
        D.Normal(0.0, -1.0)
    finally:
        D.Distribution.set_default_validate_args(True)
    with pytest.raises(NotImplementedError):
        D.Cauchy(0.0, 1.0).enumerate_support()


@pytest.mark.parametrize("name,matrix", [
    ("covariance_matrix", [[2.0, 1.0], [0.0, 2.0]]),   # not symmetric: its lower triangle was used
    ("covariance_matrix", [[1.0, 2.0], [2.0, 1.0]]),   # symmetric, an eigenvalue < 0
    ("precision_matrix", [[1.0, 2.0], [2.0, 1.0]]),
])
def test_multivariate_normal_refuses_a_matrix_that_is_not_positive_definite(name, matrix):
    with pytest.raises(ValueError, match=f"Expected parameter {name} .*PositiveDefinite"):
        D.MultivariateNormal([0.0, 0.0], validate_args=True, **{name: matrix})
    good = D.MultivariateNormal([0.0, 0.0], covariance_matrix=[[2.0, 1.0], [1.0, 2.0]], validate_args=True)
    expected = st.multivariate_normal([0, 0], [[2, 1], [1, 2]]).logpdf([0.5, -1.0])
    assert abs(float(good.log_prob(tf.constant([0.5, -1.0]))) - expected) < 1e-5


def test_geometric_refuses_probs_zero_as_torch():
    with pytest.raises(ValueError, match="Expected parameter probs .* to be positive"):
        D.Geometric(probs=0.0, validate_args=True)
    with pytest.raises(ValueError, match="to be positive"):
        D.Geometric(probs=[0.5, 0.0])
    assert abs(float(D.Geometric(probs=0.5).log_prob(2.0)) - st.geom(0.5, loc=-1).logpmf(2)) < 1e-6


def test_holes_filled_against_scipy_and_closed_forms():
    """Poisson-Poisson KL (TFP has none), Binomial entropy by enumeration, Pareto icdf, F mode."""
    exact = sum(st.poisson(2).pmf(k) * np.log(st.poisson(2).pmf(k) / st.poisson(3).pmf(k)) for k in range(80))
    np.testing.assert_allclose(float(D.kl_divergence(D.Poisson(2.0), D.Poisson(3.0))), exact, rtol=1e-6)
    np.testing.assert_allclose(D.Binomial(5, probs=[0.3, 0.5, 0.9]).entropy().numpy(),
                               [st.binom(5, p).entropy() for p in (0.3, 0.5, 0.9)], rtol=1e-6)
    u = np.array([0.1, 0.5, 0.99], np.float32)
    np.testing.assert_allclose(D.Pareto(1.5, 2.0).icdf(u).numpy(), st.pareto(2.0, scale=1.5).ppf(u), rtol=1e-5)
    np.testing.assert_allclose(D.Pareto(1.5, 2.0).cdf(D.Pareto(1.5, 2.0).icdf(u)).numpy(), u, rtol=1e-5)
    mode = D.FisherSnedecor([5.0, 2.0], [6.0, 6.0]).mode.numpy()
    assert abs(mode[0] - 0.6 * 6 / 8) < 1e-6 and np.isnan(mode[1])  # torch: NaN for df1 <= 2
    grid = np.linspace(0.01, 3, 3000)
    assert abs(grid[np.argmax(st.f(5, 6).pdf(grid))] - mode[0]) < 2e-3  # the density's argmax
