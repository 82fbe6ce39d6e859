"""Distribution: torch.distributions' base class, on TensorFlow.

Shapes follow torch: ``sample(sample_shape)`` has shape
``sample_shape + batch_shape + event_shape``; ``log_prob(value)`` reduces the
event dims.  Methods a distribution does not define raise
``NotImplementedError`` exactly where torch's do.
"""

from __future__ import annotations

import functools
import inspect
import threading

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.distributions import constraints
from tfdist.distributions.utils import as_shape, onto_mesh_of
from tfdist.tensor._api import DTensor

__all__ = ["Distribution"]

_VALIDATE_DEFAULT = True  # torch validates by default (when not under -O)


_METHODS = ("log_prob", "cdf", "icdf", "entropy", "sample", "rsample", "sample_n", "perplexity", "enumerate_support")
_PROPERTIES = ("mean", "mode", "variance", "stddev")
_SAMPLERS = ("sample", "rsample", "sample_n")
_depth = threading.local()


def _public(fn):
    """A public method or property getter that speaks tfdist DTensors: tfdist DTensor arguments go in
    as TF DTensors, ordinary tensors beside DTensor parameters go onto their mesh, and the outermost
    call returns tfdist DTensors when the distribution was made from tfdist DTensors."""
    if getattr(fn, "_speaks_dtensor", False):
        return fn

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        anchor = getattr(self, "_dtensor_anchor", None)

        def arg(v):
            if isinstance(v, DTensor):
                return v.to_tf()
            if anchor is not None and isinstance(v, (tf.Tensor, np.ndarray, float, int)) and not isinstance(v, bool) \
                    and tf.executing_eagerly() and not (isinstance(v, tf.Tensor) and dtensor.is_dtensor(v)) \
                    and np.ndim(v) > 0:
                return onto_mesh_of(tf.convert_to_tensor(v, dtype=anchor.dtype if np.ndim(v) else None), anchor)
            return v

        depth = getattr(_depth, "n", 0)
        if depth == 0 and fn.__name__ in _SAMPLERS and not tf.executing_eagerly() \
                and getattr(self, "_dtensor_mesh", None) is None and _in_dtensor_program():
            raise NotImplementedError(
                f"{type(self).__name__}.{fn.__name__}() inside a tf.function that runs on a DTensor mesh needs "
                "the distribution's parameters as tfdist DTensors (they name the mesh the draw's seed lives "
                "on); these are raw TF DTensors, whose mesh a traced function does not show. Pass "
                "tfdist.tensor.DTensor.from_tf(t) into the function, or sample eagerly (the samples stay "
                "sharded like the parameters)."
            )
        _depth.n = depth + 1
        try:
            result = fn(self, *[arg(a) for a in args], **{k: arg(v) for k, v in kwargs.items()})
        except (tf.errors.InvalidArgumentError, ValueError) as e:
            if depth == 0 and args and fn.__name__ in _VALUE_METHODS and _is_broadcast_error(e):
                raise _value_shape_error(self, fn.__name__, args[0]) from None
            raise
        finally:
            _depth.n = depth
        if depth == 0 and getattr(self, "_returns_dtensors", False) and isinstance(result, tf.Tensor) \
                and tf.executing_eagerly() and dtensor.is_dtensor(result):
            return DTensor.from_tf(result)
        return result

    call._speaks_dtensor = True
    return call


_VALUE_METHODS = ("log_prob", "cdf", "icdf")


def _is_broadcast_error(e: Exception) -> bool:
    return "Incompatible shapes" in str(e) or "must match the size" in str(e)


def _shape_of(v) -> tuple | None:
    shape = getattr(v, "shape", None)
    return tuple(shape) if shape is not None else (() if isinstance(v, (int, float)) else None)


def _value_shape_error(dist, method: str, value) -> ValueError:
    """torch's complaint, at the API boundary, for a value that does not broadcast with the distribution."""
    return ValueError(
        f"{type(dist).__name__}.{method}(value): value must broadcast with the distribution's batch shape "
        f"{tuple(dist.batch_shape)} and event shape {tuple(dist.event_shape)}. Received: value of shape "
        f"{_shape_of(value)}"
    )


def _is_numeric(v) -> bool:
    """A parameter value torch accepts: a number, a tensor (TF, numpy, tfdist) or a nested list of numbers."""
    if v is None or isinstance(v, (bool, int, float, np.number, np.ndarray, tf.Tensor, tf.Variable, DTensor)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_is_numeric(x) for x in v)
    return hasattr(v, "shape") and hasattr(v, "dtype")  # other array types (a Keras variable, ...)


def _named_arguments(init, args, kwargs) -> dict:
    """The constructor's arguments by name (``inspect.signature`` reads a factory-made family's
    ``__signature__``, torch's parameter names; values passed through a bare ``*args`` have none)."""
    signature = inspect.signature(init)
    try:
        bound = signature.bind(None, *args, **kwargs).arguments
    except TypeError:
        return {}  # a wrong number of arguments: the constructor's own message
    params = {k: p.kind for k, p in signature.parameters.items()}
    named = {}
    for name, value in bound.items():
        if params[name] == inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif params[name] != inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


def _check_parameter_types(cls, init, args, kwargs) -> None:
    """A parameter of the wrong type is refused naming it (torch: 'must all be instances of numbers.Number
    or torch.Tensor'), before TF's conversion error."""
    for name, value in _named_arguments(init, args, kwargs).items():
        if name in cls.arg_constraints and not _is_numeric(value):
            raise TypeError(f"{cls.__name__}: {name} must be a number or a tensor. Received: {name}={value!r} "
                            f"(type {type(value).__name__})")


def _checked_expand(expand):
    """``expand(batch_shape)`` refuses, naming it, a shape the batch shape cannot expand to (torch's rule:
    each existing dim, aligned right, equals the new one or is 1)."""

    @functools.wraps(expand)
    def checked(self, batch_shape, _instance=None):
        try:
            new = tuple(as_shape(batch_shape))
        except (TypeError, ValueError):
            raise TypeError(f"{type(self).__name__}.expand: batch_shape must be a sequence of ints. "
                            f"Received: batch_shape={batch_shape!r}") from None
        old = tuple(self.batch_shape)
        if len(new) < len(old) or any(o not in (1, n) for o, n in zip(old[::-1], new[::-1])):
            raise ValueError(f"{type(self).__name__}.expand: batch_shape must be one the batch shape {old} "
                             f"expands to (each of its dims, from the right, equal or 1). Received: "
                             f"batch_shape={new}")
        return expand(self, batch_shape, _instance)

    checked._checks_shape = True
    return checked


def _marking(init):
    """``__init__`` that notes tfdist DTensor parameters (results come back as tfdist DTensors) and the
    first DTensor parameter (ordinary method arguments are placed on its mesh)."""
    if getattr(init, "_speaks_dtensor", False):
        return init

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        given = [v for v in (*args, *kwargs.values()) if isinstance(v, DTensor)]
        if given:
            self._returns_dtensors = True
            self._dtensor_mesh = given[0].device_mesh.root_mesh  # where draws inside a tf.function live
        _check_parameter_types(type(self), init, args, kwargs)
        try:
            init(self, *args, **kwargs)
        except (ValueError, tf.errors.InvalidArgumentError) as e:
            if not _is_broadcast_error(e):
                raise
            named = _named_arguments(init, args, kwargs)
            shapes = {k: _shape_of(v) for k, v in named.items() if k in type(self).arg_constraints}
            given = ", ".join(f"{k} of shape {v}" for k, v in shapes.items()) or f"shapes {[_shape_of(a) for a in args]}"
            raise ValueError(f"{type(self).__name__}: the parameters must broadcast to one batch shape. "
                             f"Received: {given}") from None
        if getattr(self, "_dtensor_anchor", None) is None and tf.executing_eagerly():
            for v in list(vars(self).values()):
                if isinstance(v, tf.Tensor) and dtensor.is_dtensor(v):
                    self._dtensor_anchor = v
                    break

    __init__._speaks_dtensor = True
    return __init__


def _in_dtensor_program() -> bool:
    """True while tracing a function that DTensor runs (its inputs carry layouts)."""
    graph = tf.compat.v1.get_default_graph()
    try:
        return any("_layout" in op.node_def.attr or op.type == "DTensorLayout" for op in graph.get_operations()[:64])
    except Exception:  # noqa: BLE001 - a graph we cannot inspect: be safe, no assertion
        return True


def _graph_check(ok: tf.Tensor, message: str) -> None:
    """Inside a traced function: an assertion that fails the step with torch's message
    (tf.errors.InvalidArgumentError; a traced function cannot raise a Python ValueError at run time)."""
    if _in_dtensor_program():
        return  # an op error inside a DTensor program poisons the executor for every later step
    tf.debugging.assert_equal(tf.reduce_all(ok), True, message=message)


class Distribution:
    """Base class of every distribution (torch.distributions.Distribution)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in _METHODS:
            fn = cls.__dict__.get(name)
            if callable(fn):
                setattr(cls, name, _public(fn))
        for name in _PROPERTIES:
            prop = cls.__dict__.get(name)
            if isinstance(prop, property) and prop.fget is not None:
                setattr(cls, name, property(_public(prop.fget), doc=prop.__doc__))
        if "__init__" in cls.__dict__:
            cls.__init__ = _marking(cls.__dict__["__init__"])
        if "expand" in cls.__dict__ and not getattr(cls.__dict__["expand"], "_checks_shape", False):
            cls.expand = _checked_expand(cls.__dict__["expand"])

    has_rsample = False
    has_enumerate_support = False
    arg_constraints: dict[str, constraints.Constraint] = {}
    support: constraints.Constraint | None = None

    @staticmethod
    def set_default_validate_args(value: bool) -> None:
        """Sets whether new distributions validate their arguments by default."""
        if value not in (True, False):
            raise ValueError(f"value must be True or False. Received: value={value!r}")
        global _VALIDATE_DEFAULT
        _VALIDATE_DEFAULT = value

    def __init__(self, batch_shape=(), event_shape=(), validate_args: bool | None = None) -> None:
        self._batch_shape = as_shape(batch_shape)
        self._event_shape = as_shape(event_shape)
        self._validate_args = _VALIDATE_DEFAULT if validate_args is None else validate_args
        if self._validate_args:
            self._check_parameters()

    def _check_parameters(self) -> None:
        for name, constraint in self.arg_constraints.items():
            if constraints.is_dependent(constraint) or name not in self.__dict__ and not hasattr(type(self), name):
                continue
            value = getattr(self, name, None)
            if value is None or isinstance(value, property):
                continue
            ok = constraint.check(value)
            message = (f"Expected parameter {name} ({type(value).__name__} of shape {tuple(value.shape)}) "
                       f"of distribution {type(self).__name__} to satisfy the constraint {constraint!r}, "
                       "but found invalid values")
            if not tf.executing_eagerly():
                _graph_check(ok, message)
                continue
            if not bool(tf.reduce_all(ok)):
                raise ValueError(f"{message}:\n{value}")

    # -- shapes ----------------------------------------------------------------
    @property
    def batch_shape(self) -> tf.TensorShape:
        return self._batch_shape

    @property
    def event_shape(self) -> tf.TensorShape:
        return self._event_shape

    def _extended_shape(self, sample_shape=()) -> tf.TensorShape:
        return as_shape(sample_shape).concatenate(self._batch_shape).concatenate(self._event_shape)

    def expand(self, batch_shape, _instance=None):  # pragma: no cover - per class
        raise NotImplementedError

    # -- sampling -----------------------------------------------------------------
    def sample(self, sample_shape=()) -> tf.Tensor:
        """Draws samples (not differentiable); shape ``sample_shape + batch + event``."""
        return tf.stop_gradient(self.rsample(sample_shape)) if self.has_rsample else self._sample(sample_shape)

    def rsample(self, sample_shape=()) -> tf.Tensor:
        """Draws reparameterised samples, differentiable with respect to the parameters."""
        raise NotImplementedError

    def _sample(self, sample_shape) -> tf.Tensor:
        raise NotImplementedError

    def sample_n(self, n: int) -> tf.Tensor:
        return self.sample((n,))

    # -- densities and moments -------------------------------------------------------
    def log_prob(self, value) -> tf.Tensor:
        raise NotImplementedError

    def cdf(self, value) -> tf.Tensor:
        raise NotImplementedError

    def icdf(self, value) -> tf.Tensor:
        raise NotImplementedError

    def entropy(self) -> tf.Tensor:
        raise NotImplementedError

    def enumerate_support(self, expand: bool = True) -> tf.Tensor:
        raise NotImplementedError

    @property
    def mean(self) -> tf.Tensor:
        raise NotImplementedError

    @property
    def mode(self) -> tf.Tensor:
        raise NotImplementedError(f"{type(self)} does not implement mode")

    @property
    def variance(self) -> tf.Tensor:
        raise NotImplementedError

    @property
    def stddev(self) -> tf.Tensor:
        return tf.sqrt(self.variance)

    def perplexity(self) -> tf.Tensor:
        return tf.exp(self.entropy())

    # -- validation ---------------------------------------------------------------------
    def _validate_sample(self, value) -> None:
        if not self._validate_args or self.support is None:
            return
        value = tf.convert_to_tensor(value)
        event_ndims = len(self._event_shape)
        if value.shape.rank < event_ndims or value.shape[value.shape.rank - event_ndims:] != self._event_shape:
            raise ValueError(
                f"The right-most size of value must match event_shape: {tuple(value.shape)} vs "
                f"{tuple(self._event_shape)}."
            )
        support = self.support
        if constraints.is_dependent(support):
            return
        message = (f"Expected value argument ({type(value).__name__} of shape {tuple(value.shape)}) to be "
                   f"within the support ({support!r}) of the distribution {type(self).__name__}, but found "
                   "invalid values")
        if not tf.executing_eagerly():
            _graph_check(support.check(value), message)
            return
        if not bool(tf.reduce_all(support.check(value))):
            raise ValueError(f"{message}:\n{value}")

    def __repr__(self) -> str:
        params = ", ".join(
            f"{k}: {tuple(getattr(self, k).shape) if getattr(self, k).shape.rank else float(getattr(self, k))}"
            for k in self.arg_constraints if k in self.__dict__
        )
        return f"{type(self).__name__}({params})"


# the base class's own public methods (sample, sample_n, perplexity) speak DTensor too: a family that
# samples through ``_sample`` (no rsample) returns its draw from here
for _name in _METHODS:
    if callable(Distribution.__dict__.get(_name)):
        setattr(Distribution, _name, _public(Distribution.__dict__[_name]))
del _name
