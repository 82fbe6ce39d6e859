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
