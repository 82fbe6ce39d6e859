"""KL divergence: register_kl and kl_divergence with torch's dispatch.

``kl_divergence(p, q)`` runs the function registered for the most specific
pair of types matching ``(type(p), type(q))``; when the most specific match
by ``p``'s type and the most specific by ``q``'s type disagree, the first is
used and a warning names the ambiguity (torch's rule).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import tensorflow as tf

from tfdist.distributions import _impl as d
from tfdist.distributions.distribution import Distribution

__all__ = ["register_kl", "kl_divergence"]

_KL_REGISTRY: dict[tuple[type, type], Callable] = {}
_KL_MEMOIZE: dict[tuple[type, type], Callable] = {}


def register_kl(type_p: type, type_q: type) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn(p, q)`` as KL(p || q) for instances of those types.

    Example::

        @register_kl(Normal, Normal)
        def kl_normal_normal(p, q): ...
    """
    if not (isinstance(type_p, type) and issubclass(type_p, Distribution)):
        raise TypeError(f"Expected type_p to be a Distribution subclass but got {type_p}")
    if not (isinstance(type_q, type) and issubclass(type_q, Distribution)):
        raise TypeError(f"Expected type_q to be a Distribution subclass but got {type_q}")

    def decorator(fn: Callable) -> Callable:
        _KL_REGISTRY[type_p, type_q] = fn
        _KL_MEMOIZE.clear()
        return fn

    return decorator


@functools.total_ordering
class _Match:
    """Orders candidate pairs by how far up each type's MRO they are."""

    def __init__(self, *types):
        self.types = types

    def __eq__(self, other):
        return self.types == other.types

    def __le__(self, other):
        for x, y in zip(self.types, other.types):
            if not issubclass(x, y):
                return False
            if x is not y:
                break
        return True


def _dispatch_kl(type_p: type, type_q: type) -> Callable | None:
    matches = [(p, q) for p, q in _KL_REGISTRY if issubclass(type_p, p) and issubclass(type_q, q)]
    if not matches:
        return None
    left_p, left_q = min(_Match(*m) for m in matches).types
    right_q, right_p = min(_Match(*reversed(m)) for m in matches).types
    left_fun = _KL_REGISTRY[left_p, left_q]
    right_fun = _KL_REGISTRY[right_p, right_q]
    if left_fun is not right_fun:
        warnings.warn(
            f"Ambiguous kl_divergence({type_p.__name__}, {type_q.__name__}). Please register_kl"
            f"({left_p.__name__}, {right_q.__name__})",
            RuntimeWarning,
        )
    return left_fun


def kl_divergence(p: Distribution, q: Distribution) -> tf.Tensor:
    """KL(p || q), batched like torch.

    Raises:
        NotImplementedError: no function is registered for the pair.
    """
    key = (type(p), type(q))
    if key not in _KL_MEMOIZE:
        _KL_MEMOIZE[key] = _dispatch_kl(*key)
    fn = _KL_MEMOIZE[key]
    if fn is None:
        raise NotImplementedError(
            f"No KL(p || q) is implemented for p type {type(p).__name__} and q type {type(q).__name__}"
        )
    return fn(p, q)


def _tfp_kl(p, q):
    return d.tfd().kl_divergence(p._tfp(), q._tfp())


for _pair in (
    (d.Normal, d.Normal), (d.Bernoulli, d.Bernoulli), (d.Categorical, d.Categorical),
    (d.Exponential, d.Exponential), (d.Gamma, d.Gamma), (d.Beta, d.Beta), (d.Laplace, d.Laplace),
    (d.Dirichlet, d.Dirichlet), (d.MultivariateNormal, d.MultivariateNormal), (d.Poisson, d.Poisson),
    (d.Gumbel, d.Gumbel), (d.HalfNormal, d.HalfNormal), (d.LogNormal, d.LogNormal),
):
    register_kl(*_pair)(_tfp_kl)


@register_kl(d.Uniform, d.Uniform)
def _kl_uniform_uniform(p, q):
    result = tf.math.log((q.high - q.low) / (p.high - p.low))
    outside = tf.logical_or(q.low > p.low, q.high < p.high)
    return tf.where(outside, tf.constant(float("inf"), result.dtype), result)


@register_kl(d.Independent, d.Independent)
def _kl_independent_independent(p, q):
    if p.reinterpreted_batch_ndims != q.reinterpreted_batch_ndims:
        raise NotImplementedError("KL between Independents with different event dims is not implemented")
    result = kl_divergence(p.base_dist, q.base_dist)
    n = p.reinterpreted_batch_ndims
    return tf.reduce_sum(result, axis=list(range(-n, 0))) if n else result


# -- more pairs: closed forms (derivations in the comments), each checked against
# -- numerical integration in tests/test_kl.py ---------------------------------
import math as _math  # noqa: E402

from tfdist.distributions import _more as m  # noqa: E402
from tfdist.distributions.transformed_distribution import TransformedDistribution  # noqa: E402

_EULER = 0.57721566490153286060
_INF = float("inf")


def _inf_like(x):
    return tf.fill(tf.shape(x), tf.constant(_INF, x.dtype))


@register_kl(d.Cauchy, d.Cauchy)
def _kl_cauchy_cauchy(p, q):
    return tf.math.log(((p.scale + q.scale) ** 2 + (p.loc - q.loc) ** 2) / (4 * p.scale * q.scale))


@register_kl(d.Geometric, d.Geometric)
def _kl_geometric_geometric(p, q):
    # E_p[k] = (1 - p) / p failures
    return (-p.entropy() - tf.math.log(q.probs) - (1 - p.probs) / p.probs * tf.math.log1p(-q.probs))


@register_kl(d.Pareto, d.Pareto)
def _kl_pareto_pareto(p, q):
    # support [p.scale, inf) must lie within [q.scale, inf)
    a1, s1, a2, s2 = p.alpha, p.scale, q.alpha, q.scale
    # log p(x) = log a1 + a1 log s1 - (a1 + 1) log x, and E_p[log x] = log s1 + 1 / a1
    result = (tf.math.log(a1) + a1 * tf.math.log(s1) - (a1 + 1) * (tf.math.log(s1) + 1 / a1)
              - tf.math.log(a2) - a2 * tf.math.log(s2) + (a2 + 1) * (tf.math.log(s1) + 1 / a1))
    return tf.where(s1 < s2, _inf_like(result), result)


@register_kl(d.Binomial, d.Binomial)
def _kl_binomial_binomial(p, q):
    if not bool(tf.reduce_all(tf.equal(p.total_count, q.total_count))):
        raise NotImplementedError("KL between Binomials where q.total_count != p.total_count is not implemented")
    n, pp, qq = p.total_count, p.probs, q.probs
    return n * (pp * (tf.math.log(pp) - tf.math.log(qq)) + (1 - pp) * (tf.math.log1p(-pp) - tf.math.log1p(-qq)))


@register_kl(m.OneHotCategorical, m.OneHotCategorical)
def _kl_onehot_onehot(p, q):
    return kl_divergence(p._categorical, q._categorical)


@register_kl(d.MultivariateNormal, m.LowRankMultivariateNormal)
@register_kl(m.LowRankMultivariateNormal, d.MultivariateNormal)
@register_kl(m.LowRankMultivariateNormal, m.LowRankMultivariateNormal)
def _kl_mvn_family(p, q):
    if p.event_shape != q.event_shape:
        raise ValueError("KL between multivariate normals with different event shapes cannot be computed")
    return d.tfd().kl_divergence(p._tfp(), q._tfp())


@register_kl(TransformedDistribution, TransformedDistribution)
def _kl_transformed_transformed(p, q):
    if p.transforms != q.transforms or p.event_shape != q.event_shape:
        raise NotImplementedError("KL between TransformedDistributions with different transforms")
    return kl_divergence(p.base_dist, q.base_dist)


@register_kl(d.Exponential, d.Gamma)
def _kl_exponential_gamma(p, q):
    # E_p[x] = 1/l, E_p[log x] = -gamma - log l
    ratio = q.rate / p.rate
    return (-q.concentration * tf.math.log(ratio) + ratio + tf.math.lgamma(q.concentration)
            + q.concentration * _EULER - (1 + _EULER))


@register_kl(d.Exponential, d.Normal)
def _kl_exponential_normal(p, q):
    second = 1 / p.rate ** 2 + (1 / p.rate - q.loc) ** 2  # E_p[(x - mu)^2]
    return (tf.math.log(p.rate) - 1 + tf.math.log(q.scale) + 0.5 * _math.log(2 * _math.pi)
            + second / (2 * q.scale ** 2))


@register_kl(d.Uniform, d.Normal)
def _kl_uniform_normal(p, q):
    width = p.high - p.low
    second = width ** 2 / 12 + ((p.high + p.low) / 2 - q.loc) ** 2
    return -tf.math.log(width) + tf.math.log(q.scale) + 0.5 * _math.log(2 * _math.pi) + second / (2 * q.scale ** 2)


@register_kl(d.Uniform, d.Exponential)
def _kl_uniform_exponential(p, q):
    result = -tf.math.log(p.high - p.low) - tf.math.log(q.rate) + q.rate * (p.high + p.low) / 2
    return tf.where(p.low < 0, _inf_like(result), result)


@register_kl(d.Uniform, d.Gamma)
def _kl_uniform_gamma(p, q):
    a, b = p.low, p.high
    safe_a = tf.maximum(a, 1e-30)
    e_log = (b * tf.math.log(b) - safe_a * tf.math.log(safe_a)) / (b - a) - 1  # E_p[log x]
    log_q_mean = (q.concentration * tf.math.log(q.rate) - tf.math.lgamma(q.concentration)
                  + (q.concentration - 1) * e_log - q.rate * (a + b) / 2)
    result = -tf.math.log(b - a) - log_q_mean
    return tf.where(a < 0, _inf_like(result), result)


def _support_mismatch(p, q):
    """p puts mass where q has none: KL is infinite."""
    return _inf_like(tf.convert_to_tensor(p.mean if not isinstance(p, d.Cauchy) else p.loc))


for _p, _q in (
    (d.Normal, d.Exponential), (d.Normal, d.Gamma), (d.Normal, d.Beta), (d.Normal, d.Uniform),
    (d.Normal, d.Pareto), (d.Laplace, d.Exponential), (d.Laplace, d.Gamma), (d.Laplace, d.Beta),
    (d.Laplace, d.Uniform), (d.Laplace, d.Pareto), (d.Exponential, d.Beta), (d.Exponential, d.Uniform),
    (d.Exponential, d.Pareto), (d.Gamma, d.Beta), (d.Gamma, d.Uniform), (d.Gamma, d.Pareto),
    (d.Gumbel, d.Exponential), (d.Gumbel, d.Gamma), (d.Gumbel, d.Beta), (d.Gumbel, d.Uniform),
    (d.Gumbel, d.Pareto),
):
    register_kl(_p, _q)(_support_mismatch)


# -- cross-family pairs: KL(p || q) = -H(p) - E_p[log q(x)] ------------------------
# E_p[log q] is written once per target family q from a few properties of p:
# its support bounds, mean, variance, E[log x], E[log(1 - x)] and moment
# generating function.  Where p puts mass outside q's support, KL is inf.


def _bounds(p):
    """(low, high) of p's support, broadcast to its batch shape."""
    mean = tf.convert_to_tensor(p.mean)
    inf = tf.fill(tf.shape(mean), tf.constant(_INF, mean.dtype))
    zero, one = tf.zeros_like(mean), tf.ones_like(mean)
    if isinstance(p, (d.Beta, m.ContinuousBernoulli)):
        return zero, one
    if isinstance(p, (d.Exponential, d.Gamma)):
        return zero, inf
    if isinstance(p, d.Pareto):
        return p.scale + zero, inf
    if isinstance(p, d.Uniform):
        return p.low, p.high
    return -inf, inf  # Normal, Laplace, Gumbel


def _elog(p):
    """E_p[log x] (p on positive reals)."""
    if isinstance(p, d.Beta):
        return tf.math.digamma(p.concentration1) - tf.math.digamma(p.concentration1 + p.concentration0)
    if isinstance(p, d.Exponential):
        return -_EULER - tf.math.log(p.rate)
    if isinstance(p, d.Gamma):
        return tf.math.digamma(p.concentration) - tf.math.log(p.rate)
    if isinstance(p, d.Pareto):
        return tf.math.log(p.scale) + 1 / p.alpha
    if isinstance(p, d.Uniform):
        return _uniform_elog(p.low, p.high)
    raise NotImplementedError(f"E[log x] of {type(p).__name__}")


def _uniform_elog(a, b):
    def xlogx(v):
        return tf.where(v > 0, v * tf.math.log(tf.maximum(v, 1e-30)), tf.zeros_like(v))

    return (xlogx(b) - xlogx(a)) / (b - a) - 1


def _elog1m(p):
    """E_p[log(1 - x)] (p on the unit interval)."""
    if isinstance(p, d.Beta):
        return tf.math.digamma(p.concentration0) - tf.math.digamma(p.concentration1 + p.concentration0)
    if isinstance(p, d.Uniform):
        return _uniform_elog(1 - p.high, 1 - p.low)
    raise NotImplementedError(f"E[log(1 - x)] of {type(p).__name__}")


def _mgf(p, t):
    """E_p[exp(t x)]."""
    if isinstance(p, d.Normal):
        return tf.exp(p.loc * t + 0.5 * (p.scale * t) ** 2)
    if isinstance(p, d.Exponential):
        return tf.where(t < p.rate, p.rate / (p.rate - t), tf.constant(_INF, p.rate.dtype))
    if isinstance(p, d.Gamma):
        return tf.where(t < p.rate, (1 - t / p.rate) ** -p.concentration, tf.constant(_INF, p.rate.dtype))
    if isinstance(p, d.Uniform):
        return (tf.exp(t * p.high) - tf.exp(t * p.low)) / (t * (p.high - p.low))
    raise NotImplementedError(f"the moment generating function of {type(p).__name__}")


def _cb_log_norm(q):
    """log C(lambda) of a ContinuousBernoulli: its log density at 1/2 minus the linear part."""
    half = tf.fill(tf.shape(q.probs), tf.constant(0.5, q.probs.dtype))
    return q._tfp().log_prob(half) - 0.5 * (tf.math.log(q.probs) + tf.math.log1p(-q.probs))


def _xent_normal(p, q):
    second = p.variance + (p.mean - q.loc) ** 2
    return -tf.math.log(q.scale) - 0.5 * _math.log(2 * _math.pi) - second / (2 * q.scale ** 2), None


def _xent_exponential(p, q):
    lo, _ = _bounds(p)
    return tf.math.log(q.rate) - q.rate * p.mean, lo < 0


def _xent_gamma(p, q):
    lo, _ = _bounds(p)
    k, r = q.concentration, q.rate
    return k * tf.math.log(r) - tf.math.lgamma(k) + (k - 1) * _elog(p) - r * p.mean, lo < 0


def _xent_gumbel(p, q):
    # log q = -log b - z - exp(-z), z = (x - mu) / b
    e_exp = tf.exp(q.loc / q.scale) * _mgf(p, -1 / q.scale)
    return -tf.math.log(q.scale) - (p.mean - q.loc) / q.scale - e_exp, None


def _xent_laplace(p, q):
    # p Normal: E|x - mu_q| is the mean of a folded normal
    delta, s = p.loc - q.loc, p.scale
    e_abs = (s * _math.sqrt(2 / _math.pi) * tf.exp(-delta ** 2 / (2 * s ** 2))
             + delta * (1 - 2 * d.Normal(0.0, 1.0)._tfp().cdf(-delta / s)))
    return -tf.math.log(2 * q.scale) - e_abs / q.scale, None


def _xent_uniform(p, q):
    lo, hi = _bounds(p)
    return -tf.math.log(q.high - q.low) + tf.zeros_like(lo), tf.logical_or(lo < q.low, hi > q.high)


def _xent_pareto(p, q):
    lo, _ = _bounds(p)
    return (tf.math.log(q.alpha) + q.alpha * tf.math.log(q.scale) - (q.alpha + 1) * _elog(p)), lo < q.scale


def _xent_beta(p, q):
    lo, hi = _bounds(p)
    a, b = q.concentration1, q.concentration0
    lbeta = tf.math.lgamma(a) + tf.math.lgamma(b) - tf.math.lgamma(a + b)
    outside = tf.logical_or(lo < 0, hi > 1)
    return (a - 1) * _elog(p) + (b - 1) * _elog1m(p) - lbeta, outside


def _xent_cb(p, q):
    lo, hi = _bounds(p)
    value = _cb_log_norm(q) + p.mean * tf.math.log(q.probs) + (1 - p.mean) * tf.math.log1p(-q.probs)
    return value, tf.logical_or(lo < 0, hi > 1)


_XENT = {
    d.Normal: _xent_normal, d.Exponential: _xent_exponential, d.Gamma: _xent_gamma, d.Gumbel: _xent_gumbel,
    d.Laplace: _xent_laplace, d.Uniform: _xent_uniform, d.Pareto: _xent_pareto, d.Beta: _xent_beta,
    m.ContinuousBernoulli: _xent_cb,
}


def _kl_by_cross_entropy(p, q):
    lo, hi = _bounds(p)
    # a target with bounded support cannot cover p's unbounded tail (no moment needed)
    unbounded = tf.logical_or(tf.math.is_inf(lo), tf.math.is_inf(hi))
    if type(q) in (d.Uniform, d.Beta, m.ContinuousBernoulli) and bool(tf.reduce_all(unbounded)):
        return _inf_like(lo)
    if type(q) is d.Pareto and bool(tf.reduce_all(lo < q.scale)):
        return _inf_like(lo)
    xent, outside = _XENT[type(q)](p, q)
    kl = -p.entropy() - xent
    if outside is not None:
        kl = tf.where(outside, _inf_like(kl), kl)
    return kl


for _p, _q in (
    (d.Beta, m.ContinuousBernoulli), (d.Beta, d.Exponential), (d.Beta, d.Gamma), (d.Beta, d.Normal),
    (d.Beta, d.Pareto), (d.Beta, d.Uniform), (m.ContinuousBernoulli, m.ContinuousBernoulli),
    (m.ContinuousBernoulli, d.Exponential), (m.ContinuousBernoulli, d.Normal), (m.ContinuousBernoulli, d.Pareto),
    (m.ContinuousBernoulli, d.Uniform), (d.Exponential, m.ContinuousBernoulli), (d.Exponential, d.Gumbel),
    (d.Gamma, m.ContinuousBernoulli), (d.Gamma, d.Exponential), (d.Gamma, d.Gumbel), (d.Gamma, d.Normal),
    (d.Gumbel, m.ContinuousBernoulli), (d.Gumbel, d.Normal), (d.Laplace, m.ContinuousBernoulli),
    (d.Laplace, d.Normal), (d.Normal, m.ContinuousBernoulli), (d.Normal, d.Gumbel), (d.Normal, d.Laplace),
    (d.Pareto, d.Beta), (d.Pareto, m.ContinuousBernoulli), (d.Pareto, d.Exponential), (d.Pareto, d.Gamma),
    (d.Pareto, d.Normal), (d.Pareto, d.Uniform), (d.Uniform, d.Beta), (d.Uniform, m.ContinuousBernoulli),
    (d.Uniform, d.Gumbel), (d.Uniform, d.Pareto),
):
    register_kl(_p, _q)(_kl_by_cross_entropy)


@register_kl(d.Bernoulli, d.Poisson)
def _kl_bernoulli_poisson(p, q):
    # E_p[log q(k)] = p log r - r  (k in {0, 1}; log k! = 0)
    return -p.entropy() - (p.probs * tf.math.log(q.rate) - q.rate)


@register_kl(d.Poisson, d.Bernoulli)
@register_kl(d.Poisson, d.Binomial)
def _kl_poisson_bounded(p, q):
    return _inf_like(p.rate)  # Poisson's unbounded support is not covered


@register_kl(d.ExponentialFamily, d.ExponentialFamily)
def _kl_expfamily_expfamily(p, q):
    if type(p) is not type(q):
        raise NotImplementedError("The cross KL-divergence between different exponential families cannot "
                                  "be computed using Bregman divergences")
    return d.tfd().kl_divergence(p._tfp(), q._tfp())
