"""Categorical with torch's parameterisation (torch.distributions.categorical)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ParamShape, _ProbsLogits, clamp_probs
from tfdist.distributions._tfp_backed import tfd
from tfdist.tensor.placement_types import Replicate, Shard

__all__ = ["Categorical"]


class Categorical(_ParamShape, _ProbsLogits):
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
        if self._given == "logits":
            return self._logits_value
        # torch: probs_to_logits clamps to [eps, 1 - eps], so an impossible class gets log(eps)
        logits = tf.math.log(clamp_probs(self._probs_value))
        return logits - tf.reduce_logsumexp(logits, axis=-1, keepdims=True)

    def _tfp(self):
        return tfd().Categorical(logits=self.logits, dtype=tf.int64)

    def log_prob(self, value):
        self._validate_sample(value)
        return self._tfp().log_prob(tf.cast(value, tf.int64))

    # -- draws with DTensor parameters: inverse CDF over the categories -------------------------
    def _draw_placements(self, param_placements, sample_ndim: int) -> tuple:
        """The batch dims of the parameter lead the draw after the sample dims; the categories dim has
        no counterpart (a draw is one index), so its sharding is dropped."""
        batch = len(self.batch_shape)
        return tuple(Shard(p.dim + sample_ndim) if isinstance(p, Shard) and p.dim < batch
                     else (Replicate() if isinstance(p, Shard) else p) for p in param_placements)

    def _from_uniform(self, u):
        """The first category whose cumulative probability reaches ``u``: one uniform per draw, the same
        values on any mesh (torch draws with torch.multinomial, so values differ from torch's)."""
        cdf = tf.cumsum(tf.cast(self.probs, u.dtype), axis=-1)
        below = tf.reduce_sum(tf.cast(cdf < u[..., None], tf.int64), axis=-1)
        return tf.minimum(below, self._num_events - 1)  # rounding can leave cdf[-1] a hair under 1

    def enumerate_support(self, expand=True):
        values = tf.reshape(tf.range(self._num_events, dtype=tf.int64), [-1] + [1] * len(self.batch_shape))
        return tf.broadcast_to(values, [self._num_events] + self.batch_shape.as_list()) if expand else values

    @property
    def mean(self):
        return tf.fill(self.batch_shape, tf.constant(float("nan"), self.probs.dtype))

    @property
    def variance(self):
        return tf.fill(self.batch_shape, tf.constant(float("nan"), self.probs.dtype))


class _OverCategorical:
    """For distributions built on a ``Categorical`` (``self._categorical``): its ``probs``, ``logits``
    and ``param_shape`` are theirs (Multinomial, OneHotCategorical)."""

    @property
    def probs(self):
        return self._categorical.probs

    @property
    def logits(self):
        """The normalised log-probabilities of the categories."""
        return self._categorical.logits

    @property
    def param_shape(self) -> tf.TensorShape:
        return self._categorical.param_shape
