"""RelaxedBernoulli, LogitRelaxedBernoulli with torch's parameterisation (torch.distributions.relaxed_bernoulli)."""

from __future__ import annotations

import tensorflow as tf

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ParamShape, _ProbsLogits
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.utils import as_shape

__all__ = ["RelaxedBernoulli", "LogitRelaxedBernoulli"]


class _Relaxed(_ProbsLogits):
    has_rsample = True

    def __init__(self, temperature, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        param = self._probs_value if self._given == "probs" else self._logits_value
        self.temperature = tf.cast(temperature, param.dtype)
        batch, event = self._shapes(param)
        super().__init__(batch, event, validate_args)

    def _shapes(self, param):
        return param.shape, ()

    def _extra_kwargs(self):
        return {"temperature": self.temperature}


class RelaxedBernoulli(_Relaxed):
    """RelaxedBernoulli(temperature, probs|logits): a reparameterisable relaxation on (0, 1)."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.unit_interval

    def _tfp(self):
        return tfd().RelaxedBernoulli(self.temperature, logits=self.logits)


class LogitRelaxedBernoulli(_ParamShape, _Relaxed):
    """LogitRelaxedBernoulli(temperature, probs|logits): the logit of a RelaxedBernoulli sample."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.real
    # torch leaves the flag False on this class although its rsample is reparameterised; the flag
    # follows torch, rsample works as torch's does
    has_rsample = False

    def rsample(self, sample_shape=()):
        return self._tfp().sample(as_shape(sample_shape))

    def _tfp(self):
        return tfd().Logistic(loc=self.logits / self.temperature, scale=1.0 / self.temperature)
