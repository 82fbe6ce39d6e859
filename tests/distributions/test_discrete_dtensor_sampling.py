"""Discrete families sampled with DTensor parameters: draws stay sharded like the parameters, do not
depend on the mesh, and follow the distribution.  References: scipy's ppf (the exact discrete quantile)
and pmf; torch's parameterisations (Geometric counts failures, NegativeBinomial counts successes
before total_count failures)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st
import tensorflow as tf

import tfdist
from conftest import make_mesh
from tfdist import distributions as D
from tfdist.tensor import DTensor, Replicate, Shard, distribute_tensor

U = np.array([1e-6, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999999])
P = np.array([0.05, 0.3, 0.5, 0.8, 0.97])

# family -> (tfdist distribution of a float64 parameter vector, scipy frozen distribution, parameters)
FAMILIES = {
    "Poisson": (lambda v: D.Poisson(v), lambda v: st.poisson(v), np.array([0.1, 1.0, 4.5, 30.0, 400.0])),
    "Binomial": (lambda v: D.Binomial(12, probs=v), lambda v: st.binom(12, v), P),
    "NegativeBinomial": (lambda v: D.NegativeBinomial(3.5, probs=v), lambda v: st.nbinom(3.5, 1 - v), P),
    "Geometric": (lambda v: D.Geometric(probs=v), lambda v: st.geom(v, loc=-1), P),
    "Bernoulli": (lambda v: D.Bernoulli(probs=v), lambda v: st.bernoulli(v), P),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draws_from_uniforms_are_the_exact_discrete_quantiles(family):
    """The map from a uniform u to a draw is scipy's ppf: the smallest k with cdf(k) >= u."""
    make, ref, params = FAMILIES[family]
    dist = make(tf.constant(params[None, :].repeat(len(U), 0)))
    got = dist._from_uniform(tf.constant(U[:, None].repeat(len(params), 1))).numpy()
    want = ref(params[None, :]).ppf(U[:, None])
    np.testing.assert_array_equal(got, want)


def test_categorical_draws_from_uniforms_are_its_inverse_cdf():
    probs = np.array([[0.1, 0.2, 0.7], [0.5, 0.0, 0.5]])
    got = D.Categorical(probs=tf.constant(probs))._from_uniform(tf.constant([[0.05, 0.05], [0.25, 0.5],
                                                                              [0.31, 0.51], [0.999, 0.999]]))
    np.testing.assert_array_equal(got.numpy(), [[0, 0], [1, 0], [2, 2], [2, 2]])  # a zero-probability class never


def _sharded(values: np.ndarray, mesh) -> DTensor:
    return distribute_tensor(values, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["Categorical", "OneHotCategorical"])
def test_draws_with_dtensor_parameters_stay_sharded_match_any_mesh_and_follow_the_pmf(family):
    n = 4000
    if family in ("Categorical", "OneHotCategorical"):
        params = np.tile(np.array([[0.1, 0.2, 0.7], [0.6, 0.3, 0.1]]), (4, 1)).astype(np.float32)
        make = lambda v: getattr(D, family)(probs=v)  # noqa: E731
    else:
        make, ref, base = FAMILIES[family]
        params = np.resize(base, 8).astype(np.float32)
        if family == "Poisson":
            params = np.minimum(params, 30.0)
    draws = {}
    for shape in ((2, 4), (8,)):
        tf.random.set_seed(11)
        out = make(_sharded(params, make_mesh(shape))).sample((n,))
        assert isinstance(out, DTensor) and out.placements[0] == Shard(1), out
        draws[shape] = out.numpy()
    np.testing.assert_array_equal(draws[(2, 4)], draws[(8,)])  # the same values on any mesh
    x = draws[(2, 4)]
    if family == "OneHotCategorical":
        assert set(np.unique(x)) <= {0.0, 1.0} and np.all(x.sum(-1) == 1)
        x = x.argmax(-1)
    for j in range(8):
        if family in ("Categorical", "OneHotCategorical"):
            support, probs = np.arange(3), params[j]
        else:
            frozen = ref(float(params[j]))
            support = np.arange(int(frozen.ppf(0.999)) + 1)
            probs = frozen.pmf(support)
        freq = (x[:, j][:, None] == support).mean(0)
        # each frequency within 5 standard errors of its probability
        np.testing.assert_array_less(np.abs(freq - probs), 5 * np.sqrt(probs * (1 - probs) / n) + 2e-3)
