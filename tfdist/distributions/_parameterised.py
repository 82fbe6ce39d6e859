"""Factories for families with one or two parameters, and the probs/logits base."""

from __future__ import annotations

import inspect

import numpy as np
import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import _TFPBacked, tfd
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.exp_family import ExponentialFamily
from tfdist.distributions.utils import broadcast_all

__all__ = ["torch_signature", "_two", "_positive_pair", "_one", "_OneParam", "_ProbsLogits", "_ParamShape", "_Support"]


def clamp_probs(probs: tf.Tensor) -> tf.Tensor:
    """torch's clamp_probs: into [eps, 1 - eps], eps the dtype's machine epsilon."""
    eps = float(np.finfo(probs.dtype.as_numpy_dtype).eps)
    return tf.clip_by_value(probs, eps, 1 - eps)


def _clamped_logit(probs: tf.Tensor) -> tf.Tensor:
    p = clamp_probs(probs)
    return tf.math.log(p) - tf.math.log1p(-p)


def torch_signature(*names: str) -> inspect.Signature:
    """``(self, *names, validate_args=None)``: the signature torch gives a family's ``__init__``."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter("self", kind)] + [inspect.Parameter(n, kind) for n in names]
                             + [inspect.Parameter("validate_args", kind, default=None)])


def _bind(signature: inspect.Signature, self, args: tuple, kwargs: dict) -> dict:
    """The arguments by name, or the TypeError a ``def`` with ``signature`` raises, naming the
    class and the argument."""
    try:
        bound = signature.bind(self, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{type(self).__name__}{str(signature).replace('(self, ', '(', 1)}: {e}") from None
    bound.apply_defaults()
    return bound.arguments


def _two(cls_name, tfp_name, first, second, support, has_rsample=True, mapping=None, exp_family=False):
    """A distribution with two real parameters ``first`` and ``second``."""
    base = ExponentialFamily if exp_family else _TFPBacked
    signature = torch_signature(first, second)

    def __init__(self, *args, **kwargs):
        values = _bind(signature, self, args, kwargs)
        a, b = broadcast_all(values[first], values[second])
        setattr(self, first, a)
        setattr(self, second, b)
        Distribution.__init__(self, a.shape, (), values["validate_args"])

    __init__.__signature__ = signature  # help(), IDEs: (loc, scale, validate_args=None), as torch's

    def _tfp(self):
        kwargs = (mapping or (lambda a, b: {first: a, second: b}))(getattr(self, first), getattr(self, second))
        return getattr(tfd(), tfp_name)(**kwargs)

    return type(cls_name, (base,), {
        "__init__": __init__, "_tfp": _tfp, "_params": (first, second), "support": support,
        "has_rsample": has_rsample,
        "arg_constraints": {first: constraints.real, second: constraints.positive},
        "__doc__": f"{cls_name}({first}, {second}) with torch's parameterisation.",
    })


def _positive_pair(cls_name, tfp_name, first, second, support, mapping, has_rsample=True, exp_family=False):
    cls = _two(cls_name, tfp_name, first, second, support, has_rsample, mapping, exp_family)
    cls.arg_constraints = {first: constraints.positive, second: constraints.positive}
    return cls


_Support = constraints.dependent_property  # a support computed from the parameters


class _OneParam(_TFPBacked):
    _param: str = ""
    _constraint = constraints.positive

    def __init_subclass__(cls, **kwargs):
        if "_param" in cls.__dict__:  # a family: its own signature, ``(param, validate_args=None)``
            signature = torch_signature(cls._param)

            def __init__(self, *args, **kwargs):
                values = _bind(signature, self, args, kwargs)
                (v,) = broadcast_all(values[self._param])
                setattr(self, self._param, v)
                super(_OneParam, self).__init__(v.shape, (), values["validate_args"])

            __init__.__signature__ = signature
            cls.__init__ = __init__
        super().__init_subclass__(**kwargs)  # Distribution's, which wraps the __init__ just set

    @property
    def _params(self):
        return (self._param,)


def _one(cls_name, param, make, support, *, constraint=constraints.positive, has_rsample=True,
         exp_family=False):
    """A distribution with one parameter ``param``; ``make(value)`` builds the TFP distribution."""
    bases = (_OneParam, ExponentialFamily) if exp_family else (_OneParam,)
    return type(cls_name, bases, {
        "_param": param, "arg_constraints": {param: constraint}, "support": support,
        "has_rsample": has_rsample, "_tfp": lambda self: make(getattr(self, param)),
        "__doc__": f"{cls_name}({param}) with torch's parameterisation.",
    })


class _ParamShape:
    """torch's ``param_shape``: the shape of the parameter the distribution was given (``probs`` or
    ``logits``, broadcast with the others), for the families torch gives it to."""

    @property
    def param_shape(self) -> tf.TensorShape:
        return (self._probs_value if self._given == "probs" else self._logits_value).shape


class _ProbsLogits(_TFPBacked):
    """Shared by distributions given exactly one of ``probs`` or ``logits``."""

    _event_ndims_of_param = 0

    def _set_probs_logits(self, probs, logits):
        if (probs is None) == (logits is None):
            raise ValueError("Either `probs` or `logits` must be specified, but not both.")
        if probs is not None:
            (self._probs_value,) = broadcast_all(probs)
            self._given = "probs"
        else:
            (self._logits_value,) = broadcast_all(logits)
            self._given = "logits"

    @property
    def _params(self):
        return (self._given,)

    @property
    def _dtype(self):
        return (self._probs_value if self._given == "probs" else self._logits_value).dtype


    def _extra_kwargs(self):
        return {}

    # binary events; Categorical overrides both
    @property
    def probs(self):
        return self._probs_value if self._given == "probs" else tf.sigmoid(self._logits_value)

    @property
    def logits(self):
        if self._given == "logits":
            return self._logits_value
        return _clamped_logit(self._probs_value)
