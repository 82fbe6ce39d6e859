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

from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.bernoulli import Bernoulli
from tfdist.distributions.beta import Beta
from tfdist.distributions.binomial import Binomial
from tfdist.distributions.categorical import Categorical
from tfdist.distributions.cauchy import Cauchy
from tfdist.distributions.continuous_bernoulli import ContinuousBernoulli
from tfdist.distributions.dirichlet import Dirichlet
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.exp_family import ExponentialFamily
from tfdist.distributions.exponential import Exponential
from tfdist.distributions.gamma import Gamma
from tfdist.distributions.geometric import Geometric
from tfdist.distributions.gumbel import Gumbel
from tfdist.distributions.half_normal import HalfNormal
from tfdist.distributions.independent import Independent
from tfdist.distributions.laplace import Laplace
from tfdist.distributions.log_normal import LogNormal
from tfdist.distributions.lowrank_multivariate_normal import LowRankMultivariateNormal
from tfdist.distributions.multivariate_normal import MultivariateNormal
from tfdist.distributions.normal import Normal
from tfdist.distributions.one_hot_categorical import OneHotCategorical
from tfdist.distributions.pareto import Pareto
from tfdist.distributions.poisson import Poisson
from tfdist.distributions.uniform import Uniform

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
    for name, d in (("p", p), ("q", q)):
        if not isinstance(d, Distribution):
            raise TypeError(f"kl_divergence: {name} must be a tfdist.distributions.Distribution. Received: "
                            f"{name} of type {type(d).__name__}")
    try:
        tf.broadcast_static_shape(tf.TensorShape(p.batch_shape), tf.TensorShape(q.batch_shape))
    except ValueError:
        raise ValueError(f"kl_divergence: p and q must have batch shapes that broadcast together. Received: "
                         f"p.batch_shape={tuple(p.batch_shape)}, q.batch_shape={tuple(q.batch_shape)}") from None
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
    return tfd().kl_divergence(p._tfp(), q._tfp())


for _pair in (
    (Normal, Normal), (Bernoulli, Bernoulli),
    (Exponential, Exponential), (Gamma, Gamma), (Beta, Beta), (Laplace, Laplace),
    (Dirichlet, Dirichlet), (MultivariateNormal, MultivariateNormal),
    (Gumbel, Gumbel), (HalfNormal, HalfNormal), (LogNormal, LogNormal),
):
    register_kl(*_pair)(_tfp_kl)


@register_kl(Categorical, Categorical)
def _kl_categorical_categorical(p, q):
    """torch's: infinite where q gives a class probability 0 that p does not, 0 terms where p is 0."""
    p_probs, q_probs = p.probs, q.probs
    terms = p_probs * (p.logits - q.logits)
    terms = tf.where(tf.equal(q_probs, 0), tf.constant(float("inf"), terms.dtype), terms)
    terms = tf.where(tf.equal(p_probs, 0), tf.zeros_like(terms), terms)
    return tf.reduce_sum(terms, axis=-1)


@register_kl(Uniform, Uniform)
def _kl_uniform_uniform(p, q):
    result = tf.math.log((q.high - q.low) / (p.high - p.low))
    outside = tf.logical_or(q.low > p.low, q.high < p.high)
    return tf.where(outside, tf.constant(float("inf"), result.dtype), result)


@register_kl(Independent, Independent)
def _kl_independent_independent(p, q):
    if p.reinterpreted_batch_ndims != q.reinterpreted_batch_ndims:
        raise NotImplementedError("KL between Independents with different event dims is not implemented")
    result = kl_divergence(p.base_dist, q.base_dist)
    n = p.reinterpreted_batch_ndims
    return tf.reduce_sum(result, axis=list(range(-n, 0))) if n else result


# -- more pairs: closed forms (derivations in the comments), each checked against
# -- numerical integration in tests/test_kl.py ---------------------------------
import math as _math  # noqa: E402

from tfdist.distributions.transformed_distribution import TransformedDistribution  # noqa: E402

_EULER = 0.57721566490153286060
_INF = float("inf")


def _inf_like(x):
    return tf.fill(tf.shape(x), tf.constant(_INF, x.dtype))


@register_kl(Cauchy, Cauchy)
def _kl_cauchy_cauchy(p, q):
    return tf.math.log(((p.scale + q.scale) ** 2 + (p.loc - q.loc) ** 2) / (4 * p.scale * q.scale))


@register_kl(Geometric, Geometric)
def _kl_geometric_geometric(p, q):
    # E_p[k] = (1 - p) / p failures
    return (-p.entropy() - tf.math.log(q.probs) - (1 - p.probs) / p.probs * tf.math.log1p(-q.probs))


@register_kl(Pareto, Pareto)
def _kl_pareto_pareto(p, q):
    # support [p.scale, inf) must lie within [q.scale, inf)
    a1, s1, a2, s2 = p.alpha, p.scale, q.alpha, q.scale
    # log p(x) = log a1 + a1 log s1 - (a1 + 1) log x, and E_p[log x] = log s1 + 1 / a1
    result = (tf.math.log(a1) + a1 * tf.math.log(s1) - (a1 + 1) * (tf.math.log(s1) + 1 / a1)
              - tf.math.log(a2) - a2 * tf.math.log(s2) + (a2 + 1) * (tf.math.log(s1) + 1 / a1))
    return tf.where(s1 < s2, _inf_like(result), result)


@register_kl(Poisson, Poisson)
def _kl_poisson_poisson(p, q):
    # sum_k p(k) log(p(k)/q(k)) = rate_p log(rate_p / rate_q) - rate_p + rate_q (TFP has no such pair)
    return p.rate * (tf.math.log(p.rate) - tf.math.log(q.rate)) - p.rate + q.rate


@register_kl(Binomial, Binomial)
def _kl_binomial_binomial(p, q):
    if not bool(tf.reduce_all(tf.equal(p.total_count, q.total_count))):
        raise NotImplementedError("KL between Binomials where q.total_count != p.total_count is not implemented")
    n, pp, qq = p.total_count, p.probs, q.probs
    return n * (pp * (tf.math.log(pp) - tf.math.log(qq)) + (1 - pp) * (tf.math.log1p(-pp) - tf.math.log1p(-qq)))


@register_kl(OneHotCategorical, OneHotCategorical)
def _kl_onehot_onehot(p, q):
    return kl_divergence(p._categorical, q._categorical)


@register_kl(MultivariateNormal, LowRankMultivariateNormal)
@register_kl(LowRankMultivariateNormal, MultivariateNormal)
@register_kl(LowRankMultivariateNormal, LowRankMultivariateNormal)
def _kl_mvn_family(p, q):
    if p.event_shape != q.event_shape:
        raise ValueError("KL between multivariate normals with different event shapes cannot be computed")
    return tfd().kl_divergence(p._tfp(), q._tfp())


@register_kl(TransformedDistribution, TransformedDistribution)
def _kl_transformed_transformed(p, q):
    if p.transforms != q.transforms or p.event_shape != q.event_shape:
        raise NotImplementedError("KL between TransformedDistributions with different transforms")
    return kl_divergence(p.base_dist, q.base_dist)


@register_kl(Exponential, Gamma)
def _kl_exponential_gamma(p, q):
    # E_p[x] = 1/l, E_p[log x] = -gamma - log l
    ratio = q.rate / p.rate
    return (-q.concentration * tf.math.log(ratio) + ratio + tf.math.lgamma(q.concentration)
            + q.concentration * _EULER - (1 + _EULER))


@register_kl(Exponential, Normal)
def _kl_exponential_normal(p, q):
    second = 1 / p.rate ** 2 + (1 / p.rate - q.loc) ** 2  # E_p[(x - mu)^2]
    return (tf.math.log(p.rate) - 1 + tf.math.log(q.scale) + 0.5 * _math.log(2 * _math.pi)
            + second / (2 * q.scale ** 2))


@register_kl(Uniform, Normal)
def _kl_uniform_normal(p, q):
    width = p.high - p.low
    second = width ** 2 / 12 + ((p.high + p.low) / 2 - q.loc) ** 2
    return -tf.math.log(width) + tf.math.log(q.scale) + 0.5 * _math.log(2 * _math.pi) + second / (2 * q.scale ** 2)


@register_kl(Uniform, Exponential)
def _kl_uniform_exponential(p, q):
    result = -tf.math.log(p.high - p.low) - tf.math.log(q.rate) + q.rate * (p.high + p.low) / 2
    return tf.where(p.low < 0, _inf_like(result), result)


@register_kl(Uniform, Gamma)
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
    return _inf_like(tf.convert_to_tensor(p.mean if not isinstance(p, Cauchy) else p.loc))


for _p, _q in (
    (Normal, Exponential), (Normal, Gamma), (Normal, Beta), (Normal, Uniform),
    (Normal, Pareto), (Laplace, Exponential), (Laplace, Gamma), (Laplace, Beta),
    (Laplace, Uniform), (Laplace, Pareto), (Exponential, Beta), (Exponential, Uniform),
    (Exponential, Pareto), (Gamma, Beta), (Gamma, Uniform), (Gamma, Pareto),
    (Gumbel, Exponential), (Gumbel, Gamma), (Gumbel, Beta), (Gumbel, Uniform),
    (Gumbel, Pareto),
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
    if isinstance(p, (Beta, ContinuousBernoulli)):
        return zero, one
    if isinstance(p, (Exponential, Gamma)):
        return zero, inf
    if isinstance(p, Pareto):
        return p.scale + zero, inf
    if isinstance(p, Uniform):
        return p.low, p.high
    return -inf, inf  # Normal, Laplace, Gumbel


def _elog(p):
    """E_p[log x] (p on positive reals)."""
    if isinstance(p, Beta):
        return tf.math.digamma(p.concentration1) - tf.math.digamma(p.concentration1 + p.concentration0)
    if isinstance(p, Exponential):
        return -_EULER - tf.math.log(p.rate)
    if isinstance(p, Gamma):
        return tf.math.digamma(p.concentration) - tf.math.log(p.rate)
    if isinstance(p, Pareto):
        return tf.math.log(p.scale) + 1 / p.alpha
    if isinstance(p, Uniform):
        return _uniform_elog(p.low, p.high)
    raise NotImplementedError(f"E[log x] of {type(p).__name__}")


def _uniform_elog(a, b):
    def xlogx(v):
        return tf.where(v > 0, v * tf.math.log(tf.maximum(v, 1e-30)), tf.zeros_like(v))

    return (xlogx(b) - xlogx(a)) / (b - a) - 1


def _elog1m(p):
    """E_p[log(1 - x)] (p on the unit interval)."""
    if isinstance(p, Beta):
        return tf.math.digamma(p.concentration0) - tf.math.digamma(p.concentration1 + p.concentration0)
    if isinstance(p, Uniform):
        return _uniform_elog(1 - p.high, 1 - p.low)
    raise NotImplementedError(f"E[log(1 - x)] of {type(p).__name__}")


def _mgf(p, t):
    """E_p[exp(t x)]."""
    if isinstance(p, Normal):
        return tf.exp(p.loc * t + 0.5 * (p.scale * t) ** 2)
    if isinstance(p, Exponential):
        return tf.where(t < p.rate, p.rate / (p.rate - t), tf.constant(_INF, p.rate.dtype))
    if isinstance(p, Gamma):
        return tf.where(t < p.rate, (1 - t / p.rate) ** -p.concentration, tf.constant(_INF, p.rate.dtype))
    if isinstance(p, Uniform):
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
             + delta * (1 - 2 * Normal(tf.zeros_like(s), tf.ones_like(s))._tfp().cdf(-delta / s)))
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
    Normal: _xent_normal, Exponential: _xent_exponential, Gamma: _xent_gamma, Gumbel: _xent_gumbel,
    Laplace: _xent_laplace, Uniform: _xent_uniform, Pareto: _xent_pareto, Beta: _xent_beta,
    ContinuousBernoulli: _xent_cb,
}


def _kl_by_cross_entropy(p, q):
    lo, hi = _bounds(p)
    # a target with bounded support cannot cover p's unbounded tail (no moment needed)
    unbounded = tf.logical_or(tf.math.is_inf(lo), tf.math.is_inf(hi))
    if type(q) in (Uniform, Beta, ContinuousBernoulli) and bool(tf.reduce_all(unbounded)):
        return _inf_like(lo)
    if type(q) is Pareto and bool(tf.reduce_all(lo < q.scale)):
        return _inf_like(lo)
    xent, outside = _XENT[type(q)](p, q)
    kl = -p.entropy() - xent
    if outside is not None:
        kl = tf.where(outside, _inf_like(kl), kl)
    return kl


for _p, _q in (
    (Beta, ContinuousBernoulli), (Beta, Exponential), (Beta, Gamma), (Beta, Normal),
    (Beta, Pareto), (Beta, Uniform), (ContinuousBernoulli, ContinuousBernoulli),
    (ContinuousBernoulli, Exponential), (ContinuousBernoulli, Normal), (ContinuousBernoulli, Pareto),
    (ContinuousBernoulli, Uniform), (Exponential, ContinuousBernoulli), (Exponential, Gumbel),
    (Gamma, ContinuousBernoulli), (Gamma, Exponential), (Gamma, Gumbel), (Gamma, Normal),
    (Gumbel, ContinuousBernoulli), (Gumbel, Normal), (Laplace, ContinuousBernoulli),
    (Laplace, Normal), (Normal, ContinuousBernoulli), (Normal, Gumbel), (Normal, Laplace),
    (Pareto, Beta), (Pareto, ContinuousBernoulli), (Pareto, Exponential), (Pareto, Gamma),
    (Pareto, Normal), (Pareto, Uniform), (Uniform, Beta), (Uniform, ContinuousBernoulli),
    (Uniform, Gumbel), (Uniform, Pareto),
):
    register_kl(_p, _q)(_kl_by_cross_entropy)


@register_kl(Bernoulli, Poisson)
def _kl_bernoulli_poisson(p, q):
    # E_p[log q(k)] = p log r - r  (k in {0, 1}; log k! = 0)
    return -p.entropy() - (p.probs * tf.math.log(q.rate) - q.rate)


@register_kl(Poisson, Bernoulli)
@register_kl(Poisson, Binomial)
def _kl_poisson_bounded(p, q):
    return _inf_like(p.rate)  # Poisson's unbounded support is not covered


@register_kl(ExponentialFamily, ExponentialFamily)
def _kl_expfamily_expfamily(p, q):
    if type(p) is not type(q):
        raise NotImplementedError("The cross KL-divergence between different exponential families cannot "
                                  "be computed using Bregman divergences")
    return tfd().kl_divergence(p._tfp(), q._tfp())
