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

    def entropy(self):
        """0 where probs = 1 (success at once), as torch; TFP gives NaN there."""
        probs = tf.convert_to_tensor(self.probs)
        return tf.where(probs >= 1, tf.zeros_like(probs), self._tfp().entropy())
