"""OneHotCategorical with torch's parameterisation (torch.distributions.one_hot_categorical)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions.categorical import Categorical, _OverCategorical
from tfdist.distributions.distribution import Distribution

__all__ = ["OneHotCategorical", "OneHotCategoricalStraightThrough"]


class OneHotCategorical(_OverCategorical, Distribution):
    """OneHotCategorical(probs|logits): one-hot vectors of length K."""

    arg_constraints = {"probs": constraints.simplex, "logits": constraints.real_vector}
    support = constraints.one_hot
    has_enumerate_support = True

    def __init__(self, probs=None, logits=None, validate_args=None):
        self._categorical = Categorical(probs=probs, logits=logits, validate_args=validate_args)
        k = self._categorical._num_events
        super().__init__(self._categorical.batch_shape, (k,), validate_args)

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


class OneHotCategoricalStraightThrough(OneHotCategorical):
    """OneHotCategorical whose ``rsample`` passes gradients straight through to ``probs``.

    The forward value is a one-hot sample; its gradient is that of ``probs``
    (Bengio et al., 2013), as in torch.

    Example::

        d = OneHotCategoricalStraightThrough(logits=logits)
        y = d.rsample()          # one-hot; dy/dlogits = dprobs/dlogits
    """

    has_rsample = True

    def rsample(self, sample_shape=()):
        samples = self.sample(sample_shape)
        probs = self.probs
        return samples + (probs - tf.stop_gradient(probs))

    def expand(self, batch_shape, _instance=None):
        return OneHotCategoricalStraightThrough(logits=self._categorical.expand(batch_shape).logits)
