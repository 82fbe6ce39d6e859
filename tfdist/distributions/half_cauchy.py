"""HalfCauchy with torch's parameterisation (torch.distributions.half_cauchy)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["HalfCauchy"]


HalfCauchy = _one("HalfCauchy", "scale", lambda s: tfd().HalfCauchy(loc=tf.zeros_like(s), scale=s),
                  constraints.nonnegative)
