"""MixtureSameFamily with torch's parameterisation (torch.distributions.mixture_same_family)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.categorical import Categorical
from tfdist.distributions.distribution import Distribution
from tfdist.distributions.utils import as_shape

__all__ = ["MixtureSameFamily"]


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
        return constraints.MixtureSameFamilyConstraint(self.component_distribution.support)

    def expand(self, batch_shape, _instance=None):
        batch_shape = as_shape(batch_shape)
        k = self.mixture_distribution._num_events
        return MixtureSameFamily(self.mixture_distribution.expand(batch_shape),
                                 self.component_distribution.expand(batch_shape.concatenate([k])))

    def log_prob(self, x):
        x = tf.convert_to_tensor(x)
        event = len(self.event_shape)
        x = tf.expand_dims(x, axis=x.shape.rank - event)  # over the component dim
        comp = self.component_distribution.log_prob(x)
        return tf.reduce_logsumexp(comp + tf.nn.log_softmax(self.mixture_distribution.logits, -1), axis=-1)

    def cdf(self, x):
        """The mixture-weighted sum of the components' cdfs (univariate components, as torch)."""
        x = tf.convert_to_tensor(x)
        x = tf.expand_dims(x, axis=x.shape.rank - len(self.event_shape))  # over the component dim
        return tf.reduce_sum(self.component_distribution.cdf(x) * self.mixture_distribution.probs, axis=-1)

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
