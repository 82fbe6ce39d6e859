"""Beta with torch's parameterisation (torch.distributions.beta)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Beta"]


_Beta = _positive_pair("Beta", "Beta", "concentration1", "concentration0", constraints.unit_interval,
                       lambda a, b: {"concentration1": a, "concentration0": b}, exp_family=True)


class Beta(_Beta):
    __doc__ = _Beta.__doc__

    @property
    def mode(self):
        """torch's: the first coordinate of the Dirichlet([c1, c0]) mode -- (c1 - 1)+ / ((c1 - 1)+ + (c0 - 1)+),
        the edge 0 or 1 where the density is largest there, the larger concentration's edge when both
        are below 1, NaN when both are 1."""
        a, b = self.concentration1, self.concentration0
        am1, bm1 = tf.maximum(a - 1, 0.0), tf.maximum(b - 1, 0.0)
        interior = am1 / (am1 + bm1)
        corner = tf.cast(a > b, a.dtype)  # argmax picks the first of equal ones: 0 -> mode 1
        corner = tf.where(tf.equal(a, b), tf.ones_like(a), corner)
        return tf.where(tf.logical_and(a < 1, b < 1), corner, interior)
