"""tfdist.distributions against torch.distributions itself, at interior and edge parameters.

Reference: fixtures/torch_edges.json, written by fixtures/generate_torch_edges.py
running torch 2.13 (float64): mean, mode, variance, stddev, entropy, support,
log_prob, cdf, icdf and enumerate_support for every family, NaN and infinity
positions included.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

import tfdist.distributions as D

FIXTURES = json.loads((pathlib.Path(__file__).parent / "fixtures" / "torch_edges.json").read_text())
CASES = FIXTURES["cases"]

# torch is wrong here, tfdist keeps the right value (docs/distributions.md): torch's Kumaraswamy mode
# formula gives NaN for every parameter; the mode of Kumaraswamy(2, 3) is ((a-1)/(ab-1))^(1/a) = 0.4472
TORCH_BUGS = {("Kumaraswamy", "mode")}
# torch raises NotImplementedError, tfdist computes (from TFP): a superset, kept on purpose
EXTENSIONS = {("Bernoulli", "cdf"), ("Beta", "cdf"), ("Binomial", "cdf"), ("Categorical", "cdf"),
              ("ContinuousBernoulli", "mode"), ("Geometric", "cdf"), ("NegativeBinomial", "cdf"),
              ("Poisson", "cdf"), ("StudentT", "cdf"), ("VonMises", "cdf"), ("VonMises", "entropy"),
              ("VonMises", "perplexity")}


def _decode(x):
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(x, x) if isinstance(x, str) else x


def _dist(case):
    kwargs = {k: (np.asarray(v, np.float64) if isinstance(v, (list, float)) else v) for k, v in case["params"].items()}
    return getattr(D, case["family"])(**kwargs, validate_args=False)


def _calls(case, dist):
    points = np.asarray(case["points"], np.float64)
    calls = {p: (lambda p=p: getattr(dist, p)) for p in ("mean", "mode", "variance", "stddev")}
    calls.update(entropy=dist.entropy, perplexity=dist.perplexity, log_prob=lambda: dist.log_prob(points), cdf=lambda: dist.cdf(points))
    if "icdf" in case:
        calls["icdf"] = lambda: dist.icdf(np.asarray(case["qs"], np.float64))
    if "enumerate_support" in case:
        calls["enumerate_support"] = lambda: dist.enumerate_support(expand=False)
    return calls


def _ids(case):
    return f"{case['family']}-" + "-".join(f"{k}{v}" for k, v in case["params"].items())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_values_match_torch(case):
    dist = _dist(case)
    for name, call in _calls(case, dist).items():
        ref = case[name]
        key = (case["family"], name)
        if "error" in ref:
            if key in EXTENSIONS:
                continue
            with pytest.raises(Exception) as info:  # torch's exception type
                call()
            assert type(info.value).__name__ == ref["error"], (name, info.value)
            continue
        got = np.asarray(call(), np.float64)
        want = np.asarray(_decode(ref["value"]), np.float64)
        if key in TORCH_BUGS and np.isnan(want).all() and np.isfinite(got).all():
            continue  # torch's NaN where the value exists
        got = np.broadcast_to(got, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=f"{case['family']}.{name}")
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{case['family']}.{name} NaNs")
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"{case['family']}.{name} infs")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_support_is_torchs_constraint(case):
    dist = _dist(case)
    assert repr(dist.support) == case["support"]
    assert dist.support.event_dim == case["event_dim"]


KL = FIXTURES["kl"]
# torch answers inf for KL(ContinuousBernoulli || Uniform(low, high)) whenever low >= 0 or high <= 1, so
# also for Uniform(0, 2), which covers [0, 1]: the divergence there is -H(p) + log 2, finite; tfdist keeps it
KL_TORCH_BUGS = {("ContinuousBernoulli", "Uniform")}


def _make(family, params):
    kwargs = {k: (np.asarray(v, np.float64) if isinstance(v, (list, float)) else v) for k, v in params.items()}
    return getattr(D, family)(**kwargs, validate_args=False)


@pytest.mark.parametrize("pair", KL, ids=[f"{k['p']}-{k['q']}" for k in KL])
def test_kl_divergence_matches_torch(pair):
    got = np.asarray(D.kl_divergence(_make(pair["p"], pair["p_params"]), _make(pair["q"], pair["q_params"])),
                     np.float64)
    want = np.asarray(_decode(pair["value"]), np.float64)
    if (pair["p"], pair["q"]) in KL_TORCH_BUGS and np.isinf(want).all():
        p = _make(pair["p"], pair["p_params"])
        q = _make(pair["q"], pair["q_params"])
        want = -np.asarray(p.entropy(), np.float64) + np.log(float(q.high) - float(q.low))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


def test_extensions_are_still_extensions():
    """Every (family, method) listed as a tfdist extension is one torch refuses in the fixtures."""
    refused = {(c["family"], m) for c in CASES for m in ("mode", "cdf", "entropy", "perplexity")
               if "error" in c.get(m, {})}
    assert EXTENSIONS <= refused


def test_validate_args_inside_tf_function_with_torchs_message():
    import tensorflow as tf

    @tf.function(autograph=False)
    def log_prob(scale, x):
        return D.Normal(0.0, scale, validate_args=True).log_prob(x)

    np.testing.assert_allclose(log_prob(tf.constant(1.0), tf.constant(0.5)).numpy(), -1.0439385, rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Expected parameter scale .* to satisfy the constraint "
                                                             "GreaterThan"):
        log_prob(tf.constant(-1.0), tf.constant(0.5))

    @tf.function(autograph=False)
    def exponential(x):
        return D.Exponential(1.0, validate_args=True).log_prob(x)

    with pytest.raises(tf.errors.InvalidArgumentError, match="Expected value argument .* within the support"):
        exponential(tf.constant(-1.0))
    with pytest.raises(ValueError, match="Expected value argument"):  # eagerly: torch's ValueError
        D.Exponential(1.0, validate_args=True).log_prob(-1.0)
