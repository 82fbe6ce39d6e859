"""torch's module paths, and the two families torch has beyond the first batch.

References are numpy: torch's stick-breaking formula written out, the change
of variables with a finite-difference Jacobian, and the softmax gradient
derived by hand.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import scipy.stats as st
import tensorflow as tf

from tfdist import distributions as D

TORCH_PATHS = {
    "normal.Normal", "exp_family.ExponentialFamily", "utils.broadcast_all", "bernoulli.Bernoulli",
    "beta.Beta", "binomial.Binomial", "categorical.Categorical", "cauchy.Cauchy", "chi2.Chi2",
    "continuous_bernoulli.ContinuousBernoulli", "dirichlet.Dirichlet", "exponential.Exponential",
    "fishersnedecor.FisherSnedecor", "gamma.Gamma", "geometric.Geometric", "gumbel.Gumbel",
    "half_cauchy.HalfCauchy", "half_normal.HalfNormal", "independent.Independent",
    "inverse_gamma.InverseGamma", "kumaraswamy.Kumaraswamy", "laplace.Laplace", "lkj_cholesky.LKJCholesky",
    "log_normal.LogNormal", "logistic_normal.LogisticNormal",
    "lowrank_multivariate_normal.LowRankMultivariateNormal", "mixture_same_family.MixtureSameFamily",
    "multinomial.Multinomial", "multivariate_normal.MultivariateNormal",
    "negative_binomial.NegativeBinomial", "one_hot_categorical.OneHotCategorical",
    "one_hot_categorical.OneHotCategoricalStraightThrough", "pareto.Pareto", "poisson.Poisson",
    "relaxed_bernoulli.RelaxedBernoulli", "relaxed_bernoulli.LogitRelaxedBernoulli",
    "relaxed_categorical.RelaxedOneHotCategorical", "studentT.StudentT",
    "transformed_distribution.TransformedDistribution", "uniform.Uniform", "von_mises.VonMises",
    "weibull.Weibull", "wishart.Wishart", "kl.kl_divergence", "kl.register_kl",
    "transforms.StickBreakingTransform", "constraint_registry.biject_to", "distribution.Distribution",
}


@pytest.mark.parametrize("path", sorted(TORCH_PATHS))
def test_torch_module_path(path):
    module, name = path.rsplit(".", 1)
    obj = getattr(importlib.import_module(f"tfdist.distributions.{module}"), name)
    if name[0].isupper() and hasattr(D, name):
        assert getattr(D, name) is obj  # the package exports the same object


def test_transforms_are_exported_at_the_top_level():
    for name in ("ExpTransform", "AffineTransform", "StickBreakingTransform", "ComposeTransform", "identity_transform"):
        assert getattr(D, name) is getattr(D.transforms, name)
        assert name in D.__all__


def test_tensor_utils_path():
    from tfdist.tensor import compute_local_shape_and_global_offset
    from tfdist.tensor._utils import compute_local_shape_and_global_offset as utils_version

    assert utils_version is compute_local_shape_and_global_offset


def _torch_stick_breaking(x: np.ndarray) -> np.ndarray:
    """torch.distributions.transforms.StickBreakingTransform._call, in numpy."""
    k = x.shape[-1]
    offset = k + 1 - np.cumsum(np.ones(k))
    z = 1.0 / (1.0 + np.exp(-(x - np.log(offset))))
    z_cumprod = np.cumprod(1 - z, axis=-1)
    return np.concatenate([z, [1.0]]) * np.concatenate([[1.0], z_cumprod])


def _inverse_by_newton(y: np.ndarray, k: int) -> np.ndarray:
    x = np.zeros(k)
    for _ in range(50):
        f = _torch_stick_breaking(x)[:k] - y[:k]
        jac = _jacobian(x)
        x = x - np.linalg.solve(jac, f)
    return x


def _jacobian(x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    k = x.shape[0]
    cols = [(_torch_stick_breaking(x + h * e)[:k] - _torch_stick_breaking(x - h * e)[:k]) / (2 * h) for e in np.eye(k)]
    return np.stack(cols, axis=1)


def test_logistic_normal_log_prob_is_the_change_of_variables():
    loc, scale = np.array([0.3, -0.5, 1.0]), np.array([0.7, 1.2, 0.5])
    d = D.LogisticNormal(tf.constant(loc, tf.float64), tf.constant(scale, tf.float64))
    assert d.event_shape == (4,) and d.batch_shape == ()
    x = np.array([0.1, 0.4, -0.3])
    y = _torch_stick_breaking(x)
    want = st.norm(loc, scale).logpdf(x).sum() - np.log(abs(np.linalg.det(_jacobian(x))))
    np.testing.assert_allclose(d.log_prob(tf.constant(y)).numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(_inverse_by_newton(y, 3), x, atol=1e-8)


def test_logistic_normal_samples_are_stick_broken_normals():
    loc, scale = np.array([0.3, -0.5]), np.array([0.7, 1.2])
    d = D.LogisticNormal(tf.constant(loc, tf.float64), tf.constant(scale, tf.float64))
    tf.random.set_seed(7)
    y = d.rsample((4000,)).numpy()
    assert y.shape == (4000, 3)
    np.testing.assert_allclose(y.sum(-1), 1.0, atol=1e-12)
    x = np.stack([_inverse_by_newton(row, 2) for row in y[:200]])
    # the preimages are normal with the given loc/scale (KS test per coordinate)
    for j in range(2):
        assert st.kstest(x[:, j], st.norm(loc[j], scale[j]).cdf).pvalue > 1e-3
    assert d.expand([5]).batch_shape == (5,) and d.support is D.constraints.simplex


def test_one_hot_straight_through_gradient_is_the_softmax_gradient():
    logits = tf.constant([0.2, -0.4, 1.1], tf.float64)
    w = np.array([1.0, 3.0, -2.0])
    with tf.GradientTape() as tape:
        tape.watch(logits)
        d = D.OneHotCategoricalStraightThrough(logits=logits)
        sample = d.rsample()
        loss = tf.reduce_sum(sample * w)
    p = np.exp(logits.numpy()) / np.exp(logits.numpy()).sum()
    want = p * (w - (p * w).sum())  # d/dlogits sum(softmax(logits) * w), by hand
    np.testing.assert_allclose(tape.gradient(loss, logits).numpy(), want, rtol=1e-10)
    assert sorted(sample.numpy().tolist()) == [0.0, 0.0, 1.0]
    assert d.has_rsample and not D.OneHotCategorical(logits=logits).has_rsample
