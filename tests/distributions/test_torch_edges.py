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
import tensorflow as tf

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
              ("VonMises", "perplexity"), ("RelaxedBernoulli", "cdf")} | {
    # LogitRelaxedBernoulli(T, logits) is exactly Logistic(logits / T, 1 / T): its moments exist (test below)
    ("LogitRelaxedBernoulli", m) for m in ("mean", "mode", "variance", "stddev", "entropy", "perplexity", "cdf")}


def _decode(x):
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(x, x) if isinstance(x, str) else x


def _build(value):
    """A parameter from the fixtures: an array, a number, a distribution or transforms (composites)."""
    if isinstance(value, dict) and "family" in value:
        return _make(value["family"], value["params"])
    if isinstance(value, dict) and "transform" in value:
        return getattr(D.transforms, value["transform"])(**{k: _build(v) for k, v in value["params"].items()})
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [_build(v) for v in value]
    return np.asarray(value, np.float64) if isinstance(value, (list, float)) else value


def _make(family, params):
    return getattr(D, family)(**{k: _build(v) for k, v in params.items()}, validate_args=False)


def _dist(case):
    return _make(case["family"], case["params"])


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
def test_support_and_flags_are_torchs(case):
    dist = _dist(case)
    assert repr(dist.support) == case["support"]
    assert dist.support.event_dim == case["event_dim"]
    assert (dist.support.is_discrete, dist.has_rsample, dist.has_enumerate_support) == \
        (case["is_discrete"], case["has_rsample"], case["has_enumerate_support"])


def test_every_family_is_in_the_torch_sweep():
    """Each public distribution class is compared with torch above, so every NotImplementedError tfdist
    raises for mean/mode/variance/stddev/entropy/perplexity/log_prob/cdf/icdf is one torch raises too (or
    an extension listed in EXTENSIONS): test_values_match_torch fails on any other."""
    classes = {name for name in D.__all__
               if isinstance(getattr(D, name), type) and issubclass(getattr(D, name), D.Distribution)}
    abstract = {"Distribution", "ExponentialFamily"}
    assert classes - abstract <= {c["family"] for c in CASES}


KL = FIXTURES["kl"]
# torch answers inf for KL(ContinuousBernoulli || Uniform(low, high)) whenever low >= 0 or high <= 1, so
# also for Uniform(0, 2), which covers [0, 1]: the divergence there is -H(p) + log 2, finite; tfdist keeps it
KL_TORCH_BUGS = {("ContinuousBernoulli", "Uniform")}


@pytest.mark.parametrize("pair", KL, ids=[f"{k['p']}-{k['q']}" for k in KL])
def test_kl_divergence_matches_torch(pair):
    if "error" in pair:
        with pytest.raises(Exception) as info:
            D.kl_divergence(_make(pair["p"], pair["p_params"]), _make(pair["q"], pair["q_params"]))
        assert type(info.value).__name__ == pair["error"]
        return
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
    refused = {(c["family"], m) for c in CASES for m in _calls(c, _dist(c)) if "error" in c.get(m, {})}
    assert EXTENSIONS <= refused


def test_relaxed_bernoulli_extensions_against_scipy():
    """What torch refuses for the relaxed Bernoullis, against scipy's logistic distribution."""
    import scipy.stats as st

    temperature, probs = 0.5, 0.3
    logistic = st.logistic(loc=math.log(probs / (1 - probs)) / temperature, scale=1 / temperature)
    d = D.LogitRelaxedBernoulli(np.float64(temperature), probs=np.float64(probs))
    np.testing.assert_allclose([float(d.mean), float(d.mode), float(d.variance), float(d.entropy())],
                               [logistic.mean(), logistic.median(), logistic.var(), logistic.entropy()], rtol=1e-10)
    x = np.array([0.1, 0.5, 0.9])
    np.testing.assert_allclose(np.asarray(d.cdf(x)), logistic.cdf(x), rtol=1e-10)
    relaxed = D.RelaxedBernoulli(np.float64(temperature), probs=np.float64(probs))  # sigmoid of the logistic
    np.testing.assert_allclose(np.asarray(relaxed.cdf(x)), logistic.cdf(np.log(x / (1 - x))), rtol=1e-10)


def test_validate_args_inside_tf_function_with_torchs_message():
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


TRANSFORMS = FIXTURES["transforms"]


@pytest.mark.parametrize("case", TRANSFORMS, ids=[c["transform"] for c in TRANSFORMS])
def test_transform_matches_torch(case):
    """forward, inverse, log|det J|, sign, bijective, domain and codomain: torch's values or its refusal."""
    t = _build({"transform": case["transform"], "params": case["params"]})
    x = np.asarray(case["x"], np.float64)
    y = t(tf.constant(x))
    np.testing.assert_allclose(np.asarray(y), _decode(case["forward"]), rtol=1e-10, atol=1e-12)
    calls = {"inverse": lambda: t.inv(y), "log_abs_det_jacobian": lambda: t.log_abs_det_jacobian(tf.constant(x), y),
             "sign": lambda: t.sign}
    for name, call in calls.items():
        ref = case[name]
        if "error" in ref:
            with pytest.raises(Exception) as info:
                call()
            assert type(info.value).__name__ == ref["error"], (name, info.value)
        else:
            np.testing.assert_allclose(np.asarray(call(), np.float64), _decode(ref["value"]), rtol=1e-9, atol=1e-12,
                                       err_msg=name)
    assert t.bijective == case["bijective"]
    assert (repr(t.domain), repr(t.codomain)) == (case["domain"], case["codomain"])


def test_transform_equality_is_torchs():
    """torch compares transforms by class and parameter values, so equal transform lists give a KL."""
    T = D.transforms
    assert T.AffineTransform(1.0, 2.0) == T.AffineTransform(1.0, 2.0) != T.AffineTransform(1.0, 3.0)
    assert T.PowerTransform(2.0) == T.PowerTransform(2.0) != T.PowerTransform(3.0)
    assert T.SigmoidTransform() == T.SigmoidTransform() != T.TanhTransform()
    assert T.ComposeTransform([T.ExpTransform(), T.AffineTransform(0.0, 2.0)]) == \
        T.ComposeTransform([T.ExpTransform(), T.AffineTransform(0.0, 2.0)])
    assert len({T.ExpTransform(), T.ExpTransform(), T.AbsTransform()}) == 2
    cdf = D.Normal(0.0, 1.0)
    assert T.CumulativeDistributionTransform(cdf) != T.CumulativeDistributionTransform(cdf)  # torch: identity


INVALID = FIXTURES["invalid"]
# Outside the support torch's formulas give numbers that are no probability (a negative cdf, a finite
# log-density where the density is 0); tfdist returns the true value, derived by hand here
TRUE_OUTSIDE_SUPPORT = {("Exponential", "cdf"): [0.0], ("Gamma", "cdf"): [0.0], ("HalfNormal", "cdf"): [0.0],
                        ("HalfCauchy", "cdf"): [0.0], ("Pareto", "cdf"): [0.0], ("Pareto", "log_prob"): [-math.inf],
                        ("Weibull", "log_prob"): [-math.inf]}


def _invalid_id(case):
    return f"{case['kind']}-{case['family']}-" + "-".join(f"{k}{v}" for k, v in case["params"].items())


@pytest.mark.parametrize("case", INVALID, ids=[_invalid_id(c) for c in INVALID])
def test_invalid_values_without_validation_follow_torch(case):
    """validate_args=False: points outside the support and invalid parameters give torch's values (its NaN,
    inf and finite positions), or the true value where torch's is no probability."""
    if "constructor" in case:
        # torch's StudentT builds a Chi2 that validates df even under validate_args=False; tfdist honours
        # validate_args=False and gives NaN
        assert (case["family"], case["constructor"]) == ("StudentT", "ValueError")
        assert np.isnan(float(_dist(case).log_prob(np.float64(case["points"][0]))))
        return
    dist = _dist(case)
    points = np.asarray(case["points"], np.float64)
    calls = {"log_prob": lambda: dist.log_prob(points), "cdf": lambda: dist.cdf(points),
             "mean": lambda: dist.mean, "variance": lambda: dist.variance, "entropy": dist.entropy}
    for name in [m for m in calls if m in case]:
        ref, key = case[name], (case["family"], name)
        if "error" in ref:
            if key not in EXTENSIONS:  # else torch refuses and tfdist computes (TFP's cdf)
                with pytest.raises(Exception) as info:
                    calls[name]()
                assert type(info.value).__name__ == ref["error"], (key, info.value)
            continue
        want = np.asarray(TRUE_OUTSIDE_SUPPORT.get(key) if case["kind"] == "out_of_support" and
                          key in TRUE_OUTSIDE_SUPPORT else _decode(ref["value"]), np.float64)
        got = np.broadcast_to(np.asarray(calls[name](), np.float64), want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=f"{key}")
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{key} NaNs")
