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
