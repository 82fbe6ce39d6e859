"""KL pairs against numerical integration of p * log(p / q) (scipy.integrate)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st
from scipy import integrate

from tfdist import distributions as D


def numeric_kl(p_ref, q_ref, lo, hi):
    def f(x):
        px = p_ref.pdf(x)
        return 0.0 if px == 0 else px * (p_ref.logpdf(x) - q_ref.logpdf(x))

    return integrate.quad(f, lo, hi, limit=200)[0]


CONTINUOUS = [
    ("cauchy", D.Cauchy(0.3, 1.2), D.Cauchy(-0.5, 2.0), st.cauchy(0.3, 1.2), st.cauchy(-0.5, 2.0), -np.inf, np.inf),
    ("pareto", D.Pareto(1.0, 3.0), D.Pareto(0.5, 2.0), st.pareto(3.0, scale=1.0), st.pareto(2.0, scale=0.5), 1.0, np.inf),
    ("exp-gamma", D.Exponential(1.5), D.Gamma(2.0, 3.0), st.expon(scale=1 / 1.5), st.gamma(2.0, scale=1 / 3), 0, np.inf),
    ("exp-normal", D.Exponential(1.5), D.Normal(0.5, 2.0), st.expon(scale=1 / 1.5), st.norm(0.5, 2.0), 0, np.inf),
    ("unif-normal", D.Uniform(-1.0, 2.0), D.Normal(0.5, 2.0), st.uniform(-1, 3), st.norm(0.5, 2.0), -1, 2),
    ("unif-exp", D.Uniform(0.5, 2.0), D.Exponential(1.5), st.uniform(0.5, 1.5), st.expon(scale=1 / 1.5), 0.5, 2),
    ("unif-gamma", D.Uniform(0.5, 2.0), D.Gamma(2.0, 3.0), st.uniform(0.5, 1.5), st.gamma(2.0, scale=1 / 3), 0.5, 2),
]


@pytest.mark.parametrize("name, p, q, p_ref, q_ref, lo, hi", CONTINUOUS, ids=[c[0] for c in CONTINUOUS])
def test_continuous_pairs(name, p, q, p_ref, q_ref, lo, hi):
    np.testing.assert_allclose(float(D.kl_divergence(p, q)), numeric_kl(p_ref, q_ref, lo, hi), rtol=1e-4, atol=1e-6)


def test_discrete_pairs():
    k = np.arange(0, 400)
    p_ref, q_ref = st.geom(0.3, loc=-1), st.geom(0.6, loc=-1)
    want = np.sum(p_ref.pmf(k) * (p_ref.logpmf(k) - q_ref.logpmf(k)))
    np.testing.assert_allclose(float(D.kl_divergence(D.Geometric(probs=0.3), D.Geometric(probs=0.6))), want, rtol=1e-4)
    k = np.arange(0, 11)
    p_ref, q_ref = st.binom(10, 0.3), st.binom(10, 0.6)
    want = np.sum(p_ref.pmf(k) * (p_ref.logpmf(k) - q_ref.logpmf(k)))
    np.testing.assert_allclose(float(D.kl_divergence(D.Binomial(10.0, probs=0.3), D.Binomial(10.0, probs=0.6))),
                               want, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="total_count"):
        D.kl_divergence(D.Binomial(10.0, probs=0.3), D.Binomial(5.0, probs=0.3))
    a, b = np.array([0.2, 0.3, 0.5]), np.array([0.4, 0.4, 0.2])
    np.testing.assert_allclose(float(D.kl_divergence(D.OneHotCategorical(probs=a), D.OneHotCategorical(probs=b))),
                               (a * np.log(a / b)).sum(), rtol=1e-5)


def test_support_mismatch_is_infinite():
    for p, q in ((D.Normal(0.0, 1.0), D.Exponential(1.0)), (D.Gamma(2.0, 1.0), D.Beta(1.0, 1.0)),
                 (D.Pareto(0.5, 2.0), D.Pareto(1.0, 2.0)), (D.Uniform(-1.0, 1.0), D.Exponential(1.0))):
        assert np.isinf(float(D.kl_divergence(p, q))), (type(p).__name__, type(q).__name__)


def test_low_rank_and_transformed_pairs():
    loc = np.zeros(2)
    w, diag = np.array([[1.0], [0.5]]), np.array([0.5, 1.0])
    cov = w @ w.T + np.diag(diag)
    low = D.LowRankMultivariateNormal(loc, w, diag)
    full = D.MultivariateNormal(np.array([0.5, -1.0]), covariance_matrix=np.eye(2))
    want = float(D.kl_divergence(D.MultivariateNormal(loc, covariance_matrix=cov), full))
    np.testing.assert_allclose(float(D.kl_divergence(low, full)), want, rtol=1e-5)
    exp = D.transforms.ExpTransform()
    a = D.TransformedDistribution(D.Normal(0.0, 1.0), [exp])
    b = D.TransformedDistribution(D.Normal(1.0, 2.0), [exp])
    np.testing.assert_allclose(float(D.kl_divergence(a, b)),
                               float(D.kl_divergence(D.Normal(0.0, 1.0), D.Normal(1.0, 2.0))), rtol=1e-6)
