"""Pareto with torch's parameterisation (torch.distributions.pareto)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair, _Support

__all__ = ["Pareto"]


Pareto = _positive_pair("Pareto", "Pareto", "scale", "alpha", None,
                        lambda s, a: {"concentration": a, "scale": s})


Pareto.support = _Support(lambda self: constraints.greater_than_eq(self.scale))


def _pareto_entropy(self):
    # TFP has no Pareto entropy; closed form: log(scale / alpha) + 1 / alpha + 1
    return tf.math.log(self.scale / self.alpha) + 1.0 / self.alpha + 1.0


Pareto.entropy = _pareto_entropy


def _pareto_icdf(self, value):
    # F(x) = 1 - (scale / x) ** alpha  =>  x = scale * (1 - u) ** (-1 / alpha)
    u = tf.cast(value, self.scale.dtype)
    return self.scale * tf.pow(1 - u, -1.0 / self.alpha)


Pareto.icdf = _pareto_icdf
