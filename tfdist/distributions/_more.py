"""The rest of torch.distributions' families, torch-parameterised (most over TFP)."""

from __future__ import annotations

import math

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._impl import (
    _ProbsLogits, _TFPBacked, _two, _positive_pair, Categorical, Distribution, tfd,
)
from tfdist.distributions.distribution import as_shape, broadcast_all

__all__ = [
    "NegativeBinomial", "OneHotCategorical", "Multinomial", "InverseGamma", "Kumaraswamy", "VonMises",
    "FisherSnedecor", "LowRankMultivariateNormal", "ContinuousBernoulli", "MixtureSameFamily",
    "Wishart", "RelaxedBernoulli", "LogitRelaxedBernoulli", "RelaxedOneHotCategorical", "LKJCholesky",
]

InverseGamma = _positive_pair("InverseGamma", "InverseGamma", "concentration", "rate", constraints.positive,
                              lambda c, r: {"concentration": c, "scale": r})
Kumaraswamy = _positive_pair("Kumaraswamy", "Kumaraswamy", "concentration1", "concentration0",
                             constraints.unit_interval, lambda a, b: {"concentration1": a, "concentration0": b})
VonMises = _two("VonMises", "VonMises", "loc", "concentration", constraints.interval(-math.pi, math.pi),
                has_rsample=False)


class FisherSnedecor(_TFPBacked):
    """FisherSnedecor(df1, df2): the F distribution (closed-form density; chi-square ratio samples)."""

    arg_constraints = {"df1": constraints.positive, "df2": constraints.positive}
    support = constraints.positive
    has_rsample = True
    _params = ("df1", "df2")

    def __init__(self, df1, df2, validate_args=None):
        self.df1, self.df2 = broadcast_all(df1, df2)
        super().__init__(self.df1.shape, (), validate_args)

    def rsample(self, sample_shape=()):
        shape = as_shape(sample_shape)
        x1 = tfd().Chi2(self.df1).sample(shape) / self.df1
        x2 = tfd().Chi2(self.df2).sample(shape) / self.df2
        return x1 / x2

    def log_prob(self, value):
        self._validate_sample(value)
        x = tf.cast(value, self.df1.dtype)
        d1, d2 = self.df1, self.df2
        lbeta = tf.math.lgamma(d1 / 2) + tf.math.lgamma(d2 / 2) - tf.math.lgamma((d1 + d2) / 2)
        return (d1 / 2 * tf.math.log(d1 / d2) + (d1 / 2 - 1) * tf.math.log(x)
                - (d1 + d2) / 2 * tf.math.log1p(d1 * x / d2) - lbeta)

    @property
    def mean(self):
        m = self.df2 / (self.df2 - 2)
        return tf.where(self.df2 > 2, m, tf.constant(float("nan"), m.dtype))

    @property
    def variance(self):
        d1, d2 = self.df1, self.df2
        v = 2 * d2 ** 2 * (d1 + d2 - 2) / (d1 * (d2 - 2) ** 2 * (d2 - 4))
        return tf.where(d2 > 4, v, tf.constant(float("nan"), v.dtype))


class NegativeBinomial(_ProbsLogits):
    """NegativeBinomial(total_count, probs|logits): successes before ``total_count`` failures."""

    arg_constraints = {"total_count": constraints.greater_than_eq(0.0), "probs": constraints.half_open_interval(0.0, 1.0),
                       "logits": constraints.real}
    support = constraints.nonnegative_integer

    def __init__(self, total_count, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        param = self._probs_value if self._given == "probs" else self._logits_value
        self.total_count, param = broadcast_all(total_count, param)
        setattr(self, "_probs_value" if self._given == "probs" else "_logits_value", param)
        super().__init__(param.shape, (), validate_args)

    @property
    def _params(self):
        return (self._given, "total_count")

    def _tfp(self):
        return tfd().NegativeBinomial(total_count=self.total_count, logits=self.logits)


class OneHotCategorical(Distribution):
    """OneHotCategorical(probs|logits): one-hot vectors of length K."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}
    support = constraints.independent(constraints.boolean, 1)
    has_enumerate_support = True

    def __init__(self, probs=None, logits=None, validate_args=None):
        self._categorical = Categorical(probs=probs, logits=logits, validate_args=validate_args)
        k = self._categorical._num_events
        super().__init__(self._categorical.batch_shape, (k,), validate_args)

    @property
    def probs(self):
        return self._categorical.probs

    @property
    def logits(self):
        return self._categorical.logits

    def sample(self, sample_shape=()):
        idx = self._categorical.sample(sample_shape)
        return tf.one_hot(idx, self.event_shape[0], dtype=self.probs.dtype)

    def log_prob(self, value):
        self._validate_sample(value)
        return self._categorical.log_prob(tf.argmax(value, axis=-1))

    def entropy(self):
        return self._categorical.entropy()

    @property
    def mean(self):
        return self.probs

    @property
    def mode(self):
        return tf.one_hot(tf.argmax(self.probs, -1), self.event_shape[0], dtype=self.probs.dtype)

    @property
    def variance(self):
        return self.probs * (1 - self.probs)

    def expand(self, batch_shape, _instance=None):
        return OneHotCategorical(logits=self._categorical.expand(batch_shape).logits)

    def enumerate_support(self, expand=True):
        k = self.event_shape[0]
        values = tf.reshape(tf.eye(k, dtype=self.probs.dtype), [k] + [1] * len(self.batch_shape) + [k])
        return tf.broadcast_to(values, [k] + self.batch_shape.as_list() + [k]) if expand else values


class Multinomial(Distribution):
    """Multinomial(total_count=1, probs|logits): counts over K categories."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}

    def __init__(self, total_count=1, probs=None, logits=None, validate_args=None):
        if not isinstance(total_count, int):
            raise NotImplementedError("inhomogeneous total_count is not supported")
        self.total_count = total_count
        self._categorical = Categorical(probs=probs, logits=logits, validate_args=validate_args)
        super().__init__(self._categorical.batch_shape, (self._categorical._num_events,), validate_args)

    @property
    def support(self):
        return constraints.independent(constraints.integer_interval(0, self.total_count), 1)

    @property
    def probs(self):
        return self._categorical.probs

    def _tfp(self):
        return tfd().Multinomial(total_count=float(self.total_count), logits=self._categorical.logits)

    def sample(self, sample_shape=()):
        return self._tfp().sample(as_shape(sample_shape))

    def log_prob(self, value):
        self._validate_sample(value)
        return self._tfp().log_prob(tf.cast(value, self.probs.dtype))

    def expand(self, batch_shape, _instance=None):
        return Multinomial(self.total_count, logits=self._categorical.expand(batch_shape).logits)

    @property
    def mean(self):
        return self.total_count * self.probs

    @property
    def variance(self):
        return self.total_count * self.probs * (1 - self.probs)


class LowRankMultivariateNormal(_TFPBacked):
    """LowRankMultivariateNormal(loc, cov_factor, cov_diag): covariance W W^T + diag(D)."""

    arg_constraints = {"loc": constraints.real_vector, "cov_factor": constraints.independent(constraints.real, 2),
                       "cov_diag": constraints.independent(constraints.positive, 1)}
    support = constraints.real_vector
    has_rsample = True
    _params = ("loc", "cov_factor", "cov_diag")
    _param_event_ndims = {"loc": 1, "cov_factor": 2, "cov_diag": 1}

    def __init__(self, loc, cov_factor, cov_diag, validate_args=None):
        loc = tf.convert_to_tensor(loc, dtype_hint=tf.float32)
        self.cov_factor = tf.cast(cov_factor, loc.dtype)
        self.cov_diag = tf.cast(cov_diag, loc.dtype)
        if self.cov_factor.shape[-2] != loc.shape[-1]:
            raise ValueError(
                f"cov_factor must be a batch of matrices with shape {loc.shape[-1]} x m. "
                f"Received: cov_factor shape {tuple(self.cov_factor.shape)}"
            )
        batch = tf.broadcast_static_shape(loc.shape[:-1], self.cov_factor.shape[:-2])
        self.loc = tf.broadcast_to(loc, batch.concatenate(loc.shape[-1:]))
        super().__init__(batch, loc.shape[-1:], validate_args)

    @property
    def covariance_matrix(self):
        return tf.matmul(self.cov_factor, self.cov_factor, transpose_b=True) + tf.linalg.diag(self.cov_diag)

    def _tfp(self):
        return tfd().MultivariateNormalTriL(self.loc, tf.linalg.cholesky(self.covariance_matrix))

    @property
    def mode(self):
        return self.loc


class ContinuousBernoulli(_ProbsLogits):
    """ContinuousBernoulli(probs|logits, lims=(0.499, 0.501))."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.unit_interval
    has_rsample = True

    def __init__(self, probs=None, logits=None, lims=(0.499, 0.501), validate_args=None):
        self._set_probs_logits(probs, logits)
        self._lims = lims
        param = self._probs_value if self._given == "probs" else self._logits_value
        super().__init__(param.shape, (), validate_args)

    def _extra_kwargs(self):
        return {"lims": self._lims}

    def _tfp(self):
        # TFP has no ``lims``: it Taylor-expands near p = 0.5 on its own, the
        # same purpose as torch's lims window.
        return tfd().ContinuousBernoulli(logits=self.logits)


class _Relaxed(_ProbsLogits):
    has_rsample = True

    def __init__(self, temperature, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        param = self._probs_value if self._given == "probs" else self._logits_value
        self.temperature = tf.cast(temperature, param.dtype)
        batch, event = self._shapes(param)
        super().__init__(batch, event, validate_args)

    def _shapes(self, param):
        return param.shape, ()

    def _extra_kwargs(self):
        return {"temperature": self.temperature}


class RelaxedBernoulli(_Relaxed):
    """RelaxedBernoulli(temperature, probs|logits): a reparameterisable relaxation on (0, 1)."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.unit_interval

    def _tfp(self):
        return tfd().RelaxedBernoulli(self.temperature, logits=self.logits)


class LogitRelaxedBernoulli(_Relaxed):
    """LogitRelaxedBernoulli(temperature, probs|logits): the logit of a RelaxedBernoulli sample."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.real

    def _tfp(self):
        return tfd().Logistic(loc=self.logits / self.temperature, scale=1.0 / self.temperature)


class RelaxedOneHotCategorical(_Relaxed):
    """RelaxedOneHotCategorical(temperature, probs|logits): Gumbel-softmax on the simplex."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}
    support = constraints.simplex
    _param_event_ndims = {"probs": 1, "logits": 1}

    def _shapes(self, param):
        return param.shape[:-1], param.shape[-1:]

    @property
    def probs(self):
        return tf.nn.softmax(self.logits) if self._given == "logits" else self._probs_value

    @property
    def logits(self):
        return self._logits_value if self._given == "logits" else tf.math.log(self._probs_value)

    def _tfp(self):
        return tfd().RelaxedOneHotCategorical(self.temperature, logits=self.logits)


class MixtureSameFamily(Distribution):
    """MixtureSameFamily(mixture_distribution: Categorical, component_distribution)."""

    arg_constraints: dict = {}
    has_rsample = False

    def __init__(self, mixture_distribution, component_distribution, validate_args=None):
        if not isinstance(mixture_distribution, Categorical):
            raise ValueError("The Mixture distribution needs to be an instance of torch.distributions.Categorical")
        comp_batch = component_distribution.batch_shape
        if comp_batch[-1] != mixture_distribution._num_events:
            raise ValueError(
                f"`mixture_distribution` component number ({mixture_distribution._num_events}) does not match "
                f"`component_distribution.batch_shape[-1]` ({comp_batch[-1]})"
            )
        self.mixture_distribution = mixture_distribution
        self.component_distribution = component_distribution
        super().__init__(comp_batch[:-1], component_distribution.event_shape, validate_args)

    @property
    def support(self):
        return self.component_distribution.support

    def expand(self, batch_shape, _instance=None):
        batch_shape = as_shape(batch_shape)
        k = self.mixture_distribution._num_events
        return MixtureSameFamily(self.mixture_distribution.expand(batch_shape),
                                 self.component_distribution.expand(batch_shape.concatenate([k])))

    def log_prob(self, value):
        value = tf.convert_to_tensor(value)
        event = len(self.event_shape)
        x = tf.expand_dims(value, axis=value.shape.rank - event)  # over the component dim
        comp = self.component_distribution.log_prob(x)
        return tf.reduce_logsumexp(comp + tf.nn.log_softmax(self.mixture_distribution.logits, -1), axis=-1)

    def sample(self, sample_shape=()):
        return tfd().MixtureSameFamily(
            tfd().Categorical(logits=self.mixture_distribution.logits), self.component_distribution._tfp()
        ).sample(as_shape(sample_shape))

    @property
    def mean(self):
        probs = self.mixture_distribution.probs
        probs = tf.reshape(probs, probs.shape.as_list() + [1] * len(self.event_shape))
        return tf.reduce_sum(probs * self.component_distribution.mean, axis=-1 - len(self.event_shape))

    @property
    def variance(self):
        probs = self.mixture_distribution.probs
        probs = tf.reshape(probs, probs.shape.as_list() + [1] * len(self.event_shape))
        axis = -1 - len(self.event_shape)
        mean = tf.reduce_sum(probs * self.component_distribution.mean, axis=axis, keepdims=True)
        within = tf.reduce_sum(probs * self.component_distribution.variance, axis=axis)
        between = tf.reduce_sum(probs * (self.component_distribution.mean - mean) ** 2, axis=axis)
        return within + between


class Wishart(_TFPBacked):
    """Wishart(df, covariance_matrix|precision_matrix|scale_tril)."""

    arg_constraints = {"covariance_matrix": constraints.positive_definite,
                       "precision_matrix": constraints.positive_definite,
                       "scale_tril": constraints.lower_cholesky}
    support = constraints.positive_definite
    has_rsample = True
    _params = ("df", "scale_tril")
    _param_event_ndims = {"scale_tril": 2}

    def __init__(self, df, covariance_matrix=None, precision_matrix=None, scale_tril=None, validate_args=None):
        given = [m for m in (covariance_matrix, precision_matrix, scale_tril) if m is not None]
        if len(given) != 1:
            raise ValueError("Exactly one of covariance_matrix or precision_matrix or scale_tril may be specified.")
        m = tf.convert_to_tensor(given[0], dtype_hint=tf.float32)
        if scale_tril is not None:
            self.scale_tril = m
        elif covariance_matrix is not None:
            self.scale_tril = tf.linalg.cholesky(m)
        else:
            self.scale_tril = tf.linalg.cholesky(tf.linalg.inv(m))
        self.df = tf.cast(df, m.dtype)
        p = m.shape[-1]
        if self._validate_default() and bool(tf.reduce_any(self.df <= p - 1)):
            raise ValueError(f"Expected parameter df to be greater than {p - 1} (the event size minus one).")
        super().__init__(m.shape[:-2], m.shape[-2:], validate_args)

    @staticmethod
    def _validate_default():
        from tfdist.distributions import distribution

        return distribution._VALIDATE_DEFAULT and tf.executing_eagerly()

    @property
    def covariance_matrix(self):
        return tf.matmul(self.scale_tril, self.scale_tril, transpose_b=True)

    def _tfp(self):
        return tfd().WishartTriL(df=self.df, scale_tril=self.scale_tril)


class LKJCholesky(_TFPBacked):
    """LKJCholesky(dim, concentration=1.0): Cholesky factors of correlation matrices."""

    arg_constraints = {"concentration": constraints.positive}
    support = constraints.lower_cholesky
    _params = ("concentration",)

    def __init__(self, dim, concentration=1.0, validate_args=None):
        if dim < 2:
            raise ValueError(f"Expected dim to be an integer greater than or equal to 2. Found dim={dim}.")
        self.dim = dim
        (self.concentration,) = broadcast_all(concentration)
        super().__init__(self.concentration.shape, (dim, dim), validate_args)

    def _tfp(self):
        return tfd().CholeskyLKJ(dimension=self.dim, concentration=self.concentration)

    def _extra_kwargs(self):
        return {"dim": self.dim}
