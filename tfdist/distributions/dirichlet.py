"""Dirichlet with torch's parameterisation (torch.distributions.dirichlet)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.exp_family import ExponentialFamily
from tfdist.distributions.utils import broadcast_all

__all__ = ["Dirichlet"]


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

    @property
    def mode(self):
        """torch's rule: (c - 1)+ normalised; where every concentration is below 1, the corner of the
        largest one (the density is unbounded at every corner; torch picks one)."""
        c = self.concentration
        cm1 = tf.maximum(c - 1, 0.0)
        total = tf.reduce_sum(cm1, -1, keepdims=True)
        interior = cm1 / total  # NaN where every concentration is 1 (flat), as torch
        corner = tf.one_hot(tf.argmax(interior, axis=-1), tf.shape(c)[-1], dtype=c.dtype)
        return tf.where(tf.reduce_all(c < 1, axis=-1, keepdims=True), corner, interior)

    def _tfp(self):
        return tfd().Dirichlet(self.concentration)
