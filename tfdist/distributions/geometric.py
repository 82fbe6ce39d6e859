"""Geometric with torch's parameterisation (torch.distributions.geometric)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ProbsLogits
from tfdist.distributions._tfp_backed import tfd

__all__ = ["Geometric"]


class Geometric(_ProbsLogits):
    """Geometric(probs=None, logits=None): the number of failures before the first success."""

    arg_constraints = {"probs": constraints.interval(0.0, 1.0), "logits": constraints.real}
    support = constraints.nonnegative_integer

    def __init__(self, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        shape = (self._probs_value if self._given == "probs" else self._logits_value).shape
        super().__init__(shape, (), validate_args)
        if self._validate_args and self._given == "probs" and tf.executing_eagerly():
            # beyond the unit interval, as torch: a success probability of 0 never succeeds
            probs = tf.convert_to_tensor(self.probs)
            if not bool(tf.reduce_all(probs > 0)):
                raise ValueError(
                    f"Expected parameter probs ({type(probs).__name__} of shape {tuple(probs.shape)}) of "
                    f"distribution Geometric to be positive but found invalid values:\n"
                    f"{tf.boolean_mask(tf.reshape(probs, [-1]), tf.reshape(probs <= 0, [-1]))}"
                )

    def _tfp(self):
        return tfd().Geometric(probs=self.probs)

    # torch's formulas: they also give torch's values at non-integer points and, with validate_args=False,
    # for probs outside (0, 1]
    def log_prob(self, value):
        self._validate_sample(value)
        probs = tf.convert_to_tensor(self.probs)
        value = tf.cast(value, probs.dtype)
        # 0 * log(0) is 0: a certain success at once has probability 1
        q = tf.where(tf.logical_and(probs >= 1, tf.equal(value, 0)), tf.zeros_like(value * probs), probs)
        return value * tf.math.log1p(-q) + tf.math.log(probs)

    @property
    def mean(self):
        return 1.0 / tf.convert_to_tensor(self.probs) - 1.0

    @property
    def variance(self):
        probs = tf.convert_to_tensor(self.probs)
        return (1.0 / probs - 1.0) / probs

    def entropy(self):
        """torch's binary cross-entropy of the clamped logits over probs: 0 where probs = 1."""
        probs = tf.convert_to_tensor(self.probs)
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=probs, logits=self.logits) / probs
