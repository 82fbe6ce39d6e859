"""The second batch of distributions, against scipy and closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st
import tensorflow as tf
from scipy.special import logsumexp

from tfdist import distributions as D


@pytest.fixture(autouse=True)
def _seeded():
    """Sampling tests draw from TF's RNG: a fixed seed per test keeps them deterministic."""
    tf.random.set_seed(1234)

F64 = tf.float64


def test_scalar_families_against_scipy():
    cases = [
        (D.InverseGamma(3.0, 2.0), st.invgamma(3.0, scale=2.0), np.array([0.3, 1.0, 2.5])),
        (D.VonMises(0.4, 2.0), st.vonmises(2.0, loc=0.4), np.array([-1.0, 0.3, 2.0])),
        (D.FisherSnedecor(5.0, 7.0), st.f(5.0, 7.0), np.array([0.3, 1.0, 2.5])),
    ]
    for dist, ref, x in cases:
        np.testing.assert_allclose(dist.log_prob(tf.constant(x, tf.float32)).numpy(), ref.logpdf(x), rtol=1e-4)
        np.testing.assert_allclose(float(dist.mean), ref.mean(), rtol=1e-4)
        if not isinstance(dist, D.VonMises):
            np.testing.assert_allclose(float(dist.variance), ref.var(), rtol=1e-4)
        samples = dist.sample((4000,)).numpy()
        assert st.kstest(samples, ref.cdf).pvalue > 1e-4, type(dist).__name__


def test_kumaraswamy_closed_form():
    a, b = 2.0, 3.0
    x = np.array([0.1, 0.5, 0.9])
    want = np.log(a * b) + (a - 1) * np.log(x) + (b - 1) * np.log1p(-x ** a)
    dist = D.Kumaraswamy(a, b)
    np.testing.assert_allclose(dist.log_prob(tf.constant(x, tf.float32)).numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(dist.cdf(tf.constant(x, tf.float32)).numpy(), 1 - (1 - x ** a) ** b, rtol=1e-5)


def test_negative_binomial_counts_successes_before_failures():
    dist = D.NegativeBinomial(5.0, probs=0.3)
    ref = st.nbinom(5, 0.7)  # scipy counts failures before n successes (success prob 0.7)
    k = np.array([0.0, 2.0, 7.0])
    np.testing.assert_allclose(dist.log_prob(tf.constant(k, tf.float32)).numpy(), ref.logpmf(k), rtol=1e-4)
    np.testing.assert_allclose(float(dist.mean), ref.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(dist.variance), ref.var(), rtol=1e-5)


def test_one_hot_categorical_and_multinomial():
    probs = np.array([0.2, 0.3, 0.5])
    oh = D.OneHotCategorical(probs=probs)
    assert tuple(oh.event_shape) == (3,)
    np.testing.assert_allclose(oh.log_prob(tf.constant([0.0, 0.0, 1.0])).numpy(), np.log(0.5), rtol=1e-6)
    s = oh.sample((20000,)).numpy()
    assert s.shape == (20000, 3) and np.all(s.sum(-1) == 1)
    np.testing.assert_allclose(s.mean(0), probs, atol=0.02)
    np.testing.assert_allclose(oh.enumerate_support().numpy(), np.eye(3))
    multi = D.Multinomial(10, probs=probs)
    counts = np.array([2.0, 3.0, 5.0])
    np.testing.assert_allclose(float(multi.log_prob(counts)), st.multinomial(10, probs).logpmf(counts), rtol=1e-5)
    np.testing.assert_allclose(multi.mean.numpy(), 10 * probs, rtol=1e-6)
    assert multi.sample((7,)).numpy().sum(-1).tolist() == [10.0] * 7
    with pytest.raises(NotImplementedError, match="inhomogeneous total_count"):
        D.Multinomial(tf.constant([3, 4]), probs=probs)


def test_low_rank_multivariate_normal_against_scipy():
    loc = np.array([0.5, -1.0, 0.0])
    w = np.array([[1.0], [0.5], [-0.3]])
    diag = np.array([0.5, 1.0, 2.0])
    dist = D.LowRankMultivariateNormal(tf.constant(loc, F64), w, diag)
    ref = st.multivariate_normal(loc, w @ w.T + np.diag(diag))
    v = np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    np.testing.assert_allclose(dist.log_prob(v).numpy(), ref.logpdf(v), rtol=1e-8)
    np.testing.assert_allclose(float(dist.entropy()), ref.entropy(), rtol=1e-8)
    with pytest.raises(ValueError, match="cov_factor must be a batch of matrices"):
        D.LowRankMultivariateNormal(loc, np.ones((2, 1)), diag)


def test_continuous_bernoulli_closed_form():
    lam = 0.3
    x = np.array([0.1, 0.5, 0.9])
    c = 2 * np.arctanh(1 - 2 * lam) / (1 - 2 * lam)  # normaliser
    want = np.log(c) + x * np.log(lam) + (1 - x) * np.log(1 - lam)
    dist = D.ContinuousBernoulli(probs=lam)
    np.testing.assert_allclose(dist.log_prob(tf.constant(x, tf.float32)).numpy(), want, rtol=1e-4)
    assert dist.has_rsample


def test_relaxed_distributions():
    t, p = 0.5, 0.3
    logit = np.log(p / (1 - p))
    lrb = D.LogitRelaxedBernoulli(t, probs=p)
    x = np.array([-1.0, 0.2, 1.5])
    # logistic(loc = logit / t, scale = 1 / t)
    np.testing.assert_allclose(lrb.log_prob(tf.constant(x, tf.float32)).numpy(),
                               st.logistic(loc=logit / t, scale=1 / t).logpdf(x), rtol=1e-4)
    rb = D.RelaxedBernoulli(t, probs=p)
    y = rb.sample((5000,)).numpy()
    assert np.all((y > 0) & (y < 1))
    np.testing.assert_allclose((y > 0.5).mean(), p, atol=0.03)  # rounding a relaxed sample is Bernoulli(p)
    roc = D.RelaxedOneHotCategorical(0.1, probs=[0.2, 0.3, 0.5])
    z = roc.rsample((5000,)).numpy()
    np.testing.assert_allclose(z.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.bincount(z.argmax(-1), minlength=3) / 5000, [0.2, 0.3, 0.5], atol=0.03)


def test_mixture_same_family_against_manual_mixture():
    weights = np.array([0.3, 0.7])
    locs, scales = np.array([-1.0, 2.0]), np.array([0.5, 1.5])
    mix = D.MixtureSameFamily(D.Categorical(probs=weights), D.Normal(locs, scales))
    x = np.array([-1.5, 0.0, 2.2])
    want = logsumexp(np.log(weights) + st.norm(locs, scales).logpdf(x[:, None]), axis=1)
    np.testing.assert_allclose(mix.log_prob(tf.constant(x, tf.float32)).numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(float(mix.mean), weights @ locs, rtol=1e-6)
    var = weights @ (scales ** 2 + locs ** 2) - (weights @ locs) ** 2
    np.testing.assert_allclose(float(mix.variance), var, rtol=1e-5)
    samples = mix.sample((20000,)).numpy()
    np.testing.assert_allclose(samples.mean(), weights @ locs, atol=0.05)
    with pytest.raises(ValueError, match="component number"):
        D.MixtureSameFamily(D.Categorical(probs=[0.5, 0.5]), D.Normal(np.zeros(3), np.ones(3)))


def test_wishart_and_lkj():
    cov = np.array([[2.0, 0.3], [0.3, 1.0]])
    dist = D.Wishart(tf.constant(4.0, F64), covariance_matrix=tf.constant(cov))
    x = np.array([[3.0, 0.5], [0.5, 2.0]])
    np.testing.assert_allclose(float(dist.log_prob(x)), st.wishart(4.0, cov).logpdf(x), rtol=1e-8)
    np.testing.assert_allclose(dist.mean.numpy(), 4.0 * cov, rtol=1e-8)
    with pytest.raises(ValueError, match="df to be greater than 1"):
        D.Wishart(0.5, covariance_matrix=cov)
    # torch allows p - 1 < df < p (TFP does not): density against scipy, samples against df * cov and the
    # variance df (V_ij^2 + V_ii V_jj)
    low = D.Wishart(tf.constant(1.5, F64), covariance_matrix=tf.constant(cov))
    np.testing.assert_allclose(float(low.log_prob(x)), st.wishart(1.5, cov).logpdf(x), rtol=1e-8)
    np.testing.assert_allclose(float(low.entropy()), st.wishart(1.5, cov).entropy(), rtol=1e-8)
    samples = low.sample((40000,)).numpy()
    np.testing.assert_allclose(samples.mean(0), 1.5 * cov, rtol=0.05, atol=0.02)
    np.testing.assert_allclose(samples.var(0), 1.5 * (cov ** 2 + np.outer(np.diag(cov), np.diag(cov))), rtol=0.1)
    assert np.all(np.linalg.eigvalsh(samples[:100]) > 0)
    lkj = D.LKJCholesky(3, 2.0)
    chol = lkj.sample((50,)).numpy()
    corr = chol @ np.swapaxes(chol, -1, -2)
    np.testing.assert_allclose(np.diagonal(corr, axis1=-2, axis2=-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(chol, 1) == 0)
    # concentration 1 on 2x2 makes the correlation uniform on (-1, 1): density 1/2 in r;
    # with r = L[1,0] and L[1,1] = sqrt(1 - r^2), the Cholesky density is 1/2 * |dr/dL10| ... = 1/2
    l2 = np.array([[1.0, 0.0], [0.6, 0.8]])
    np.testing.assert_allclose(float(D.LKJCholesky(2, 1.0).log_prob(l2)), np.log(0.5), rtol=1e-4)
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        D.LKJCholesky(1)


EVERY = [
    lambda: D.Normal(0.5, 2.0), lambda: D.LogNormal(0.2, 0.7), lambda: D.Laplace(0.5, 2.0),
    lambda: D.Cauchy(0.5, 2.0), lambda: D.Gumbel(0.5, 2.0), lambda: D.HalfNormal(1.5),
    lambda: D.HalfCauchy(1.5), lambda: D.Exponential(2.0), lambda: D.Gamma(2.5, 1.5), lambda: D.Chi2(3.0),
    lambda: D.Beta(2.0, 3.0), lambda: D.Uniform(-1.0, 3.0), lambda: D.StudentT(5.0, 0.5, 2.0),
    lambda: D.Pareto(2.0, 3.0), lambda: D.Weibull(2.0, 1.5), lambda: D.Bernoulli(probs=0.3),
    lambda: D.Geometric(probs=0.3), lambda: D.Poisson(2.5), lambda: D.Binomial(10.0, probs=0.3),
    lambda: D.Categorical(probs=[0.2, 0.3, 0.5]), lambda: D.Dirichlet([1.5, 2.0, 3.0]),
    lambda: D.MultivariateNormal(np.zeros(2, np.float32), covariance_matrix=np.eye(2, dtype=np.float32)),
    lambda: D.Independent(D.Normal(tf.zeros(3), tf.ones(3)), 1), lambda: D.InverseGamma(3.0, 2.0),
    lambda: D.Kumaraswamy(2.0, 3.0), lambda: D.VonMises(0.4, 2.0), lambda: D.FisherSnedecor(5.0, 7.0),
    lambda: D.NegativeBinomial(5.0, probs=0.3), lambda: D.OneHotCategorical(probs=[0.2, 0.3, 0.5]),
    lambda: D.Multinomial(4, probs=[0.2, 0.3, 0.5]),
    lambda: D.LowRankMultivariateNormal(np.zeros(2, np.float32), np.ones((2, 1), np.float32), np.ones(2, np.float32)),
    lambda: D.ContinuousBernoulli(probs=0.3), lambda: D.RelaxedBernoulli(0.5, probs=0.3),
    lambda: D.LogitRelaxedBernoulli(0.5, probs=0.3), lambda: D.RelaxedOneHotCategorical(0.5, probs=[0.2, 0.3, 0.5]),
    lambda: D.MixtureSameFamily(D.Categorical(probs=[0.3, 0.7]), D.Normal([-1.0, 2.0], [0.5, 1.5])),
    lambda: D.Wishart(4.0, covariance_matrix=np.eye(2, dtype=np.float32)), lambda: D.LKJCholesky(3, 2.0),
    lambda: D.TransformedDistribution(D.Normal(0.0, 1.0), [D.transforms.ExpTransform()]),
]


@pytest.mark.parametrize("make", EVERY, ids=lambda f: type(f()).__name__)
def test_expand_sample_and_log_prob_of_every_distribution(make):
    dist = make()
    wide = dist.expand((2, 3))
    assert tuple(wide.batch_shape) == (2, 3)
    assert wide.event_shape == dist.event_shape
    x = dist.sample((4,))
    assert tuple(x.shape) == (4,) + tuple(dist.batch_shape) + tuple(dist.event_shape)
    lp = dist.log_prob(x)
    assert tuple(lp.shape) == (4,) + tuple(dist.batch_shape)
    assert bool(tf.reduce_all(tf.math.is_finite(lp)))
    wide_lp = wide.log_prob(tf.reshape(x, [4, 1, 1] + x.shape.as_list()[1:]))
    np.testing.assert_allclose(wide_lp.numpy(), np.broadcast_to(lp.numpy().reshape([4, 1, 1]), (4, 2, 3)), rtol=1e-5)


def test_binomial_enumerate_support():
    support = D.Binomial(3.0, probs=[0.2, 0.5]).enumerate_support()
    assert support.numpy()[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and tuple(support.shape) == (4, 2)


def test_sample_n_is_a_sample_of_shape_n():
    """torch: sample_n(n) == sample((n,)): same draws under the same seed, sample shape (n,) in front."""
    dist = D.Normal(np.zeros((2, 3)), np.ones((2, 3)))
    tf.random.set_seed(7)
    a = dist.sample_n(5).numpy()
    tf.random.set_seed(7)
    b = dist.sample((5,)).numpy()
    assert a.shape == (5, 2, 3)
    np.testing.assert_array_equal(a, b)
    assert D.Categorical(probs=[0.2, 0.8]).sample_n(4).shape == (4,)
