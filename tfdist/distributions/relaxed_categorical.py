"""RelaxedOneHotCategorical with torch's parameterisation (torch.distributions.relaxed_categorical)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.relaxed_bernoulli import _Relaxed

__all__ = ["RelaxedOneHotCategorical"]


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
