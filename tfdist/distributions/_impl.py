"""torch-parameterised distributions over TensorFlow Probability.

Each class maps torch's constructor arguments onto a TFP distribution (built
lazily: TFP is imported on first use) and keeps torch's shapes, supports,
argument constraints and validation.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions.distribution import Distribution, as_shape, broadcast_all

__all__ = [
    "ExponentialFamily", "Normal", "LogNormal", "Laplace", "Cauchy", "Gumbel", "HalfNormal",
    "HalfCauchy", "Exponential", "Gamma", "Chi2", "Beta", "Uniform", "StudentT", "Pareto", "Weibull",
    "Bernoulli", "Geometric", "Poisson", "Binomial", "Categorical", "Dirichlet",
    "MultivariateNormal", "Independent",
]


@functools.lru_cache(maxsize=None)
def tfd():
    import tensorflow_probability as tfp

    return tfp.distributions


class _TFPBacked(Distribution):
    """Delegates computation to ``self._tfp()``; subclasses map the parameters."""

    _params: tuple[str, ...] = ()
    _param_event_ndims: dict[str, int] = {}

    def _tfp(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def rsample(self, sample_shape=()):
        if not self.has_rsample:
            raise NotImplementedError
        layout = self._dtensor_layout()
        if layout is not None:
            return self._sample_sharded(sample_shape, layout)
        return self._tfp().sample(as_shape(sample_shape))

    def _sample(self, sample_shape):
        layout = self._dtensor_layout()
        if layout is not None:
            return tf.stop_gradient(self._sample_sharded(sample_shape, layout))
        return tf.stop_gradient(self._tfp().sample(as_shape(sample_shape)))

    # -- DTensor parameters ---------------------------------------------------------
    def _dtensor_layout(self):
        """The layout of a parameter that is a TF DTensor (eager), else None."""
        if not tf.executing_eagerly():
            return None
        from tensorflow.experimental import dtensor

        for name in self._params:
            value = getattr(self, name)
            if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
                return dtensor.fetch_layout(value)
        return None

    def _sample_sharded(self, sample_shape, layout):
        """Samples that stay sharded like the parameters: icdf of per-shard uniforms.

        TF DTensor has no layout rule for random ops, so tfdist draws the
        uniforms with its sharding-invariant per-shard generator
        (tfdist.tensor._random) and maps them through the inverse CDF.
        """
        from tfdist.device_mesh import DeviceMesh
        from tfdist.tensor import _random
        from tfdist.tensor._layout import DTensorSpec, placements_from_tf_layout
        from tfdist.tensor._factory import _random_seed
        from tfdist.tensor.placement_types import Shard

        sample_shape = as_shape(sample_shape)
        shape = sample_shape.concatenate(self.batch_shape).concatenate(self.event_shape)
        lead = len(sample_shape) + len(self.batch_shape) - len(layout.sharding_specs)
        placements = tuple(
            Shard(p.dim + lead) if isinstance(p, Shard) else p for p in placements_from_tf_layout(layout)
        )
        spec = DTensorSpec(DeviceMesh.from_tf(layout.mesh), placements, tuple(shape.as_list()))
        bits = _random.uniform_bits(spec, _random_seed())
        u = _random._unit(bits, self._dtype, open_low=True)
        try:
            return self.icdf(u)
        except NotImplementedError as err:
            raise NotImplementedError(
                f"sampling {type(self).__name__} with DTensor parameters needs its icdf, which TFP "
                "does not provide; TF DTensor has no layout rule for random ops."
            ) from err

    def log_prob(self, value):
        self._validate_sample(value)
        return self._tfp().log_prob(tf.cast(value, self._dtype))

    def cdf(self, value):
        self._validate_sample(value)
        return self._tfp().cdf(tf.cast(value, self._dtype))

    def icdf(self, value):
        return self._tfp().quantile(tf.cast(value, self._dtype))

    def entropy(self):
        return self._tfp().entropy()

    @property
    def mean(self):
        return self._tfp().mean()

    @property
    def mode(self):
        return self._tfp().mode()

    @property
    def variance(self):
        return self._tfp().variance()

    @property
    def _dtype(self):
        return getattr(self, self._params[0]).dtype

    def expand(self, batch_shape, _instance=None):
        """The same distribution with its parameters broadcast to ``batch_shape``."""
        batch_shape = as_shape(batch_shape)
        kwargs = {}
        for name in self._params:
            value = getattr(self, name)
            event = value.shape[value.shape.rank - self._param_event_ndims.get(name, 0):]
            kwargs[name] = tf.broadcast_to(value, batch_shape.concatenate(event))
        return type(self)(**kwargs, **self._extra_kwargs())

    def _extra_kwargs(self) -> dict:
        return {}


class ExponentialFamily(_TFPBacked):
    """Marker base for exponential-family distributions (torch.distributions.ExponentialFamily)."""


def _two(cls_name, tfp_name, first, second, support, has_rsample=True, mapping=None, exp_family=False):
    """A distribution with two real parameters ``first`` and ``second``."""
    base = ExponentialFamily if exp_family else _TFPBacked

    def __init__(self, *args, validate_args=None, **kwargs):
        names = (first, second)
        values = dict(zip(names, args))
        values.update(kwargs)
        a, b = broadcast_all(values[first], values[second])
        setattr(self, first, a)
        setattr(self, second, b)
        Distribution.__init__(self, a.shape, (), validate_args)

    def _tfp(self):
        kwargs = (mapping or (lambda a, b: {first: a, second: b}))(getattr(self, first), getattr(self, second))
        return getattr(tfd(), tfp_name)(**kwargs)

    return type(cls_name, (base,), {
        "__init__": __init__, "_tfp": _tfp, "_params": (first, second), "support": support,
        "has_rsample": has_rsample,
        "arg_constraints": {first: constraints.real, second: constraints.positive},
        "__doc__": f"{cls_name}({first}, {second}) with torch's parameterisation.",
    })


Normal = _two("Normal", "Normal", "loc", "scale", constraints.real, exp_family=True)
LogNormal = _two("LogNormal", "LogNormal", "loc", "scale", constraints.positive)
Laplace = _two("Laplace", "Laplace", "loc", "scale", constraints.real)
Cauchy = _two("Cauchy", "Cauchy", "loc", "scale", constraints.real)
Gumbel = _two("Gumbel", "Gumbel", "loc", "scale", constraints.real)


def _positive_pair(cls_name, tfp_name, first, second, support, mapping, has_rsample=True, exp_family=False):
    cls = _two(cls_name, tfp_name, first, second, support, has_rsample, mapping, exp_family)
    cls.arg_constraints = {first: constraints.positive, second: constraints.positive}
    return cls


Gamma = _positive_pair("Gamma", "Gamma", "concentration", "rate", constraints.nonnegative,
                       lambda c, r: {"concentration": c, "rate": r}, exp_family=True)
Beta = _positive_pair("Beta", "Beta", "concentration1", "concentration0", constraints.unit_interval,
                      lambda a, b: {"concentration1": a, "concentration0": b}, exp_family=True)
Pareto = _positive_pair("Pareto", "Pareto", "scale", "alpha", None,
                        lambda s, a: {"concentration": a, "scale": s})
Weibull = _positive_pair("Weibull", "Weibull", "scale", "concentration", constraints.positive,
                         lambda s, k: {"concentration": k, "scale": s})


_Support = constraints.dependent_property  # a support computed from the parameters


Pareto.support = _Support(lambda self: constraints.greater_than_eq(self.scale))


class _OneParam(_TFPBacked):
    _param: str = ""
    _constraint = constraints.positive

    def __init__(self, *args, validate_args=None, **kwargs):
        if len(args) + len(kwargs) != 1 or (kwargs and self._param not in kwargs):
            raise TypeError(
                f"{type(self).__name__} takes one parameter, {self._param!r}. Received: "
                f"args={args!r}, kwargs={sorted(kwargs)!r}"
            )
        (v,) = broadcast_all(args[0] if args else kwargs[self._param])
        setattr(self, self._param, v)
        super().__init__(v.shape, (), validate_args)

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


HalfNormal = _one("HalfNormal", "scale", lambda s: tfd().HalfNormal(s), constraints.nonnegative)
HalfCauchy = _one("HalfCauchy", "scale", lambda s: tfd().HalfCauchy(loc=tf.zeros_like(s), scale=s),
                  constraints.nonnegative)
Exponential = _one("Exponential", "rate", lambda r: tfd().Exponential(r), constraints.nonnegative,
                   exp_family=True)
Chi2 = _one("Chi2", "df", lambda df: tfd().Chi2(df), constraints.nonnegative)
Poisson = _one("Poisson", "rate", lambda r: tfd().Poisson(rate=r), constraints.nonnegative_integer,
               constraint=constraints.nonnegative, has_rsample=False, exp_family=True)


class Uniform(_TFPBacked):
    """Uniform(low, high): [low, high)."""

    arg_constraints = {"low": constraints.dependent, "high": constraints.dependent}
    has_rsample = True
    _params = ("low", "high")
    support = _Support(lambda self: constraints.half_open_interval(self.low, self.high))

    def __init__(self, low, high, validate_args=None):
        self.low, self.high = broadcast_all(low, high)
        super().__init__(self.low.shape, (), validate_args)
        if self._validate_args and tf.executing_eagerly() and not bool(tf.reduce_all(self.low < self.high)):
            raise ValueError("Expected parameter low to be less than high in Uniform.")

    def _tfp(self):
        return tfd().Uniform(self.low, self.high)

    @property
    def mode(self):
        return tf.fill(tf.shape(self.low), tf.constant(float("nan"), self.low.dtype))


class StudentT(_TFPBacked):
    """StudentT(df, loc=0.0, scale=1.0)."""

    arg_constraints = {"df": constraints.positive, "loc": constraints.real, "scale": constraints.positive}
    support = constraints.real
    has_rsample = True
    _params = ("df", "loc", "scale")

    def __init__(self, df, loc=0.0, scale=1.0, validate_args=None):
        self.df, self.loc, self.scale = broadcast_all(df, loc, scale)
        super().__init__(self.df.shape, (), validate_args)

    def _tfp(self):
        return tfd().StudentT(self.df, self.loc, self.scale)

    @property
    def variance(self):
        # torch: inf for 1 < df <= 2, nan for df <= 1
        var = self.scale ** 2 * self.df / (self.df - 2)
        var = tf.where(self.df <= 2, tf.constant(float("inf"), var.dtype), var)
        return tf.where(self.df <= 1, tf.constant(float("nan"), var.dtype), var)


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
        p = tf.clip_by_value(self._probs_value, 1e-7, 1 - 1e-7)
        return tf.math.log(p) - tf.math.log1p(-p)


class Bernoulli(_ProbsLogits, ExponentialFamily):
    """Bernoulli(probs=None, logits=None)."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.boolean
    has_enumerate_support = True

    def __init__(self, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        shape = (self._probs_value if self._given == "probs" else self._logits_value).shape
        super().__init__(shape, (), validate_args)

    def _tfp(self):
        return tfd().Bernoulli(logits=self.logits, dtype=self._dtype)

    def enumerate_support(self, expand=True):
        values = tf.reshape(tf.constant([0.0, 1.0], self._dtype), [2] + [1] * len(self.batch_shape))
        return tf.broadcast_to(values, [2] + self.batch_shape.as_list()) if expand else values

    def entropy(self):
        p, logits = self.probs, self.logits
        return tf.nn.softplus(logits) - p * logits


class Geometric(_ProbsLogits):
    """Geometric(probs=None, logits=None): the number of failures before the first success."""

    arg_constraints = {"probs": constraints.interval(0.0, 1.0), "logits": constraints.real}
    support = constraints.nonnegative_integer

    def __init__(self, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        shape = (self._probs_value if self._given == "probs" else self._logits_value).shape
        super().__init__(shape, (), validate_args)

    def _tfp(self):
        return tfd().Geometric(probs=self.probs)


class Binomial(_ProbsLogits):
    """Binomial(total_count=1, probs=None, logits=None)."""

    arg_constraints = {"total_count": constraints.nonnegative_integer, "probs": constraints.unit_interval,
                       "logits": constraints.real}
    has_enumerate_support = True
    support = _Support(lambda self: constraints.integer_interval(0, self.total_count))

    def __init__(self, total_count=1, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        param = self._probs_value if self._given == "probs" else self._logits_value
        self.total_count, param = broadcast_all(total_count, param)
        if self._given == "probs":
            self._probs_value = param
        else:
            self._logits_value = param
        super().__init__(param.shape, (), validate_args)

    @property
    def _params(self):
        return (self._given, "total_count")

    def _tfp(self):
        if self._given == "probs":
            return tfd().Binomial(total_count=self.total_count, probs=self._probs_value)
        return tfd().Binomial(total_count=self.total_count, logits=self._logits_value)

    def enumerate_support(self, expand=True):
        n = tf.reduce_max(self.total_count)
        if not bool(tf.reduce_all(tf.equal(self.total_count, n))):
            raise NotImplementedError("Inhomogeneous total count not supported by `enumerate_support`.")
        values = tf.range(n + 1, dtype=self._dtype)
        values = tf.reshape(values, [-1] + [1] * len(self.batch_shape))
        return tf.broadcast_to(values, [int(n) + 1] + self.batch_shape.as_list()) if expand else values


class Categorical(_ProbsLogits):
    """Categorical(probs=None, logits=None) over ``{0, ..., K-1}`` (the last dim)."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}
    has_enumerate_support = True
    _param_event_ndims = {"probs": 1, "logits": 1}

    def __init__(self, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        if self._given == "probs":
            self._probs_value = self._probs_value / tf.reduce_sum(self._probs_value, -1, keepdims=True)
        else:
            self._logits_value = self._logits_value - tf.reduce_logsumexp(self._logits_value, -1, keepdims=True)
        param = self._probs_value if self._given == "probs" else self._logits_value
        self._num_events = param.shape[-1]
        super().__init__(param.shape[:-1], (), validate_args)

    @property
    def support(self):
        return constraints.integer_interval(0, self._num_events - 1)

    @property
    def probs(self):
        return self._probs_value if self._given == "probs" else tf.nn.softmax(self._logits_value)

    @property
    def logits(self):
        return self._logits_value if self._given == "logits" else tf.math.log(self._probs_value)

    def _tfp(self):
        return tfd().Categorical(logits=self.logits, dtype=tf.int64)

    def log_prob(self, value):
        self._validate_sample(value)
        return self._tfp().log_prob(tf.cast(value, tf.int64))

    def enumerate_support(self, expand=True):
        values = tf.reshape(tf.range(self._num_events, dtype=tf.int64), [-1] + [1] * len(self.batch_shape))
        return tf.broadcast_to(values, [self._num_events] + self.batch_shape.as_list()) if expand else values

    @property
    def mean(self):
        return tf.fill(self.batch_shape, tf.constant(float("nan"), self.probs.dtype))

    @property
    def variance(self):
        return tf.fill(self.batch_shape, tf.constant(float("nan"), self.probs.dtype))


class Dirichlet(ExponentialFamily):
    """Dirichlet(concentration)."""

    arg_constraints = {"concentration": constraints.independent(constraints.positive, 1)}
    support = constraints.simplex
    has_rsample = True
    _params = ("concentration",)
    _param_event_ndims = {"concentration": 1}

    def __init__(self, concentration, validate_args=None):
        (self.concentration,) = broadcast_all(concentration)
        if self.concentration.shape.rank < 1:
            raise ValueError("`concentration` parameter must be at least one-dimensional.")
        super().__init__(self.concentration.shape[:-1], self.concentration.shape[-1:], validate_args)

    def _tfp(self):
        return tfd().Dirichlet(self.concentration)


class MultivariateNormal(_TFPBacked):
    """MultivariateNormal(loc, covariance_matrix=None, precision_matrix=None, scale_tril=None)."""

    arg_constraints = {"loc": constraints.real_vector, "covariance_matrix": constraints.positive_definite,
                       "precision_matrix": constraints.positive_definite, "scale_tril": constraints.lower_cholesky}
    support = constraints.real_vector
    has_rsample = True
    _param_event_ndims = {"loc": 1, "scale_tril": 2}

    def __init__(self, loc, covariance_matrix=None, precision_matrix=None, scale_tril=None, validate_args=None):
        given = [m for m in (covariance_matrix, precision_matrix, scale_tril) if m is not None]
        if len(given) != 1:
            raise ValueError(
                "Exactly one of covariance_matrix or precision_matrix or scale_tril may be specified."
            )
        loc = tf.convert_to_tensor(loc, dtype_hint=tf.float32)
        if loc.shape.rank < 1:
            raise ValueError("loc must be at least one-dimensional.")
        if scale_tril is not None:
            self.scale_tril = tf.cast(scale_tril, loc.dtype)
            self._given = "scale_tril"
        elif covariance_matrix is not None:
            self.scale_tril = tf.linalg.cholesky(tf.cast(covariance_matrix, loc.dtype))
            self._given = "covariance_matrix"
        else:
            self.scale_tril = tf.linalg.cholesky(tf.linalg.inv(tf.cast(precision_matrix, loc.dtype)))
            self._given = "precision_matrix"
        batch = tf.broadcast_static_shape(loc.shape[:-1], self.scale_tril.shape[:-2])
        self.loc = tf.broadcast_to(loc, batch.concatenate(loc.shape[-1:]))
        self.scale_tril = tf.broadcast_to(self.scale_tril, batch.concatenate(self.scale_tril.shape[-2:]))
        super().__init__(batch, loc.shape[-1:], validate_args)

    _params = ("loc", "scale_tril")

    def _tfp(self):
        return tfd().MultivariateNormalTriL(self.loc, self.scale_tril)

    @property
    def covariance_matrix(self):
        return tf.matmul(self.scale_tril, self.scale_tril, transpose_b=True)

    @property
    def precision_matrix(self):
        return tf.linalg.inv(self.covariance_matrix)

    @property
    def mode(self):
        return self.loc


class Independent(Distribution):
    """Independent(base_distribution, reinterpreted_batch_ndims): batch dims become event dims."""

    arg_constraints: dict = {}

    def __init__(self, base_distribution, reinterpreted_batch_ndims, validate_args=None):
        batch = base_distribution.batch_shape
        if not 0 <= reinterpreted_batch_ndims <= len(batch):
            raise ValueError(
                "Expected reinterpreted_batch_ndims <= len(base_distribution.batch_shape), "
                f"actual {reinterpreted_batch_ndims} vs {len(batch)}"
            )
        self.base_dist = base_distribution
        self.reinterpreted_batch_ndims = reinterpreted_batch_ndims
        cut = len(batch) - reinterpreted_batch_ndims
        super().__init__(batch[:cut], batch[cut:].concatenate(base_distribution.event_shape), validate_args)

    @property
    def has_rsample(self):
        return self.base_dist.has_rsample

    @property
    def has_enumerate_support(self):
        return False if self.reinterpreted_batch_ndims else self.base_dist.has_enumerate_support

    @property
    def support(self):
        s = self.base_dist.support
        return constraints.independent(s, self.reinterpreted_batch_ndims) if self.reinterpreted_batch_ndims else s

    def _reduce(self, value):
        n = self.reinterpreted_batch_ndims
        return tf.reduce_sum(value, axis=list(range(-n, 0))) if n else value

    def rsample(self, sample_shape=()):
        return self.base_dist.rsample(sample_shape)

    def sample(self, sample_shape=()):
        return self.base_dist.sample(sample_shape)

    def log_prob(self, value):
        return self._reduce(self.base_dist.log_prob(value))

    def entropy(self):
        return self._reduce(self.base_dist.entropy())

    @property
    def mean(self):
        return self.base_dist.mean

    @property
    def mode(self):
        return self.base_dist.mode

    @property
    def variance(self):
        return self.base_dist.variance

    def enumerate_support(self, expand=True):
        if self.reinterpreted_batch_ndims > 0:
            raise NotImplementedError("Enumeration over cartesian product is not implemented")
        return self.base_dist.enumerate_support(expand=expand)

    def expand(self, batch_shape, _instance=None):
        batch_shape = as_shape(batch_shape)
        base = self.base_dist.expand(batch_shape.concatenate(self.event_shape[: self.reinterpreted_batch_ndims]))
        return Independent(base, self.reinterpreted_batch_ndims)




def _pareto_entropy(self):
    # TFP has no Pareto entropy; closed form: log(scale / alpha) + 1 / alpha + 1
    return tf.math.log(self.scale / self.alpha) + 1.0 / self.alpha + 1.0


Pareto.entropy = _pareto_entropy
