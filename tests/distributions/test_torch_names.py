"""torch names that complete the distributions' API: ``param_shape``, ``LowRankMultivariateNormal``'s
``precision_matrix``/``scale_tril``, ``Multinomial.logits``, ``Wishart.precision_matrix`` and
``rsample(max_try_correction=)``, and torch's argument names (``icdf(prob)``, ``log_prob(x)``).

References: numpy linear algebra, scipy, and shapes derived by hand from torch's definition
(``param_shape`` is the shape of the parameter given, broadcast with the others).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st
import tensorflow as tf

from tfdist import distributions as D

F64 = tf.float64


@pytest.mark.parametrize("make,shape", [
    (lambda: D.Bernoulli(probs=tf.fill([3, 2], 0.3)), (3, 2)),
    (lambda: D.Binomial(total_count=tf.fill([4, 1], 5.0), probs=tf.fill([3], 0.2)), (4, 3)),
    (lambda: D.Categorical(logits=tf.zeros([2, 5])), (2, 5)),
    (lambda: D.ContinuousBernoulli(probs=tf.fill([3], 0.4)), (3,)),
    (lambda: D.Multinomial(10, probs=tf.fill([2, 4], 0.25)), (2, 4)),
    (lambda: D.NegativeBinomial(5.0, logits=tf.zeros([3])), (3,)),
    (lambda: D.OneHotCategorical(probs=tf.fill([4], 0.25)), (4,)),
    (lambda: D.LogitRelaxedBernoulli(0.5, probs=tf.fill([2], 0.5)), (2,)),
], ids=["Bernoulli", "Binomial", "Categorical", "ContinuousBernoulli", "Multinomial", "NegativeBinomial",
        "OneHotCategorical", "LogitRelaxedBernoulli"])
def test_param_shape_is_the_given_parameters_broadcast_shape(make, shape):
    assert tuple(make().param_shape) == shape


def test_lowrank_mvn_precision_and_scale_tril_equal_numpy():
    rng = np.random.default_rng(0)
    loc, w, d = rng.normal(size=(2, 3)), rng.normal(size=(3, 2)), rng.uniform(0.5, 2.0, 3)
    dist = D.LowRankMultivariateNormal(tf.constant(loc), tf.constant(w), tf.constant(d))
    cov = w @ w.T + np.diag(d)
    np.testing.assert_allclose(dist.precision_matrix.numpy(), np.broadcast_to(np.linalg.inv(cov), (2, 3, 3)),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dist.scale_tril.numpy(), np.broadcast_to(np.linalg.cholesky(cov), (2, 3, 3)),
                               rtol=1e-12, atol=1e-12)


def test_multinomial_logits_are_normalised_log_probs():
    p = np.array([[1.0, 2.0, 5.0], [3.0, 3.0, 2.0]])
    dist = D.Multinomial(4, probs=tf.constant(p))
    np.testing.assert_allclose(dist.logits.numpy(), np.log(p / p.sum(-1, keepdims=True)), rtol=1e-12)


def test_wishart_precision_matrix_is_the_inverse_covariance():
    a = np.array([[2.0, 0.3, 0.1], [0.3, 1.5, 0.2], [0.1, 0.2, 1.0]])
    np.testing.assert_allclose(D.Wishart(5.0, covariance_matrix=tf.constant(a)).precision_matrix.numpy(),
                               np.linalg.inv(a), rtol=1e-12)
    np.testing.assert_allclose(D.Wishart(5.0, precision_matrix=tf.constant(a)).precision_matrix.numpy(), a,
                               rtol=1e-12)


def test_wishart_rsample_redraws_singular_samples(monkeypatch):
    """max_try_correction: a singular draw (here the zero matrix, by hand) is drawn again; with no
    corrections allowed it is returned with a warning, as torch does."""
    dist = D.Wishart(4.0, covariance_matrix=tf.eye(2, dtype=F64))
    draws = iter([tf.zeros([2, 2], F64), tf.eye(2, dtype=F64)])
    monkeypatch.setattr(dist, "_bartlett", lambda shape: next(draws))
    np.testing.assert_array_equal(dist.rsample(max_try_correction=3).numpy(), np.eye(2))
    monkeypatch.setattr(dist, "_bartlett", lambda shape: tf.zeros([2, 2], F64))
    with pytest.warns(UserWarning, match="singular samples remain after max_try_correction=0"):
        np.testing.assert_array_equal(dist.rsample(max_try_correction=0).numpy(), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="max_try_correction must be a non-negative int.*-1"):
        dist.rsample(max_try_correction=-1)


def test_wishart_rsample_is_positive_definite_and_has_the_mean():
    cov = np.array([[2.0, 0.5], [0.5, 1.0]])
    tf.random.set_seed(7)
    samples = D.Wishart(6.0, covariance_matrix=tf.constant(cov)).rsample((4000,)).numpy()
    assert (np.linalg.eigvalsh(samples) > 0).all()
    np.testing.assert_allclose(samples.mean(0), 6.0 * cov, rtol=0.06)


def test_torch_argument_names():
    p = np.array([0.1, 0.5, 0.9])
    np.testing.assert_allclose(D.HalfNormal(tf.constant(2.0, F64)).icdf(prob=tf.constant(p)).numpy(),
                               st.halfnorm(scale=2.0).ppf(p), rtol=1e-10)
    np.testing.assert_allclose(D.HalfCauchy(tf.constant(2.0, F64)).icdf(prob=tf.constant(p)).numpy(),
                               st.halfcauchy(scale=2.0).ppf(p), rtol=1e-10)
    weights, locs, scales = np.array([0.3, 0.7]), np.array([-1.0, 2.0]), np.array([0.5, 1.5])
    mix = D.MixtureSameFamily(D.Categorical(probs=tf.constant(weights)),
                              D.Normal(tf.constant(locs), tf.constant(scales)))
    x = np.array([-1.0, 0.0, 2.5])
    pdf = sum(w * st.norm(l, s).pdf(x) for w, l, s in zip(weights, locs, scales))
    cdf = sum(w * st.norm(l, s).cdf(x) for w, l, s in zip(weights, locs, scales))
    np.testing.assert_allclose(mix.log_prob(x=tf.constant(x)).numpy(), np.log(pdf), rtol=1e-10)
    np.testing.assert_allclose(mix.cdf(x=tf.constant(x)).numpy(), cdf, rtol=1e-10)
