"""ContinuousBernoulli with torch's parameterisation (torch.distributions.continuous_bernoulli)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ProbsLogits
from tfdist.distributions._tfp_backed import tfd

__all__ = ["ContinuousBernoulli"]


class ContinuousBernoulli(_ProbsLogits):
    """ContinuousBernoulli(probs|logits, lims=(0.499, 0.501))."""

    arg_constraints = {"probs": constraints.unit_interval, "logits": constraints.real}
    support = constraints.unit_interval
    has_rsample = True

    def __init__(self, probs=None, logits=None, lims=(0.499, 0.501), validate_args=None):
        self._set_probs_logits(probs, logits)
        self._lims = lims
        param = self._probs_value if self._given == "probs" else self._logits_value
        super().__init__(param.shape, (), validate_args)

    def _extra_kwargs(self):
        return {"lims": self._lims}

    def _tfp(self):
        # TFP has no ``lims``: it Taylor-expands near p = 0.5 on its own, the
        # same purpose as torch's lims window.
        return tfd().ContinuousBernoulli(logits=self.logits)
