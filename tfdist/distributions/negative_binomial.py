"""NegativeBinomial with torch's parameterisation (torch.distributions.negative_binomial)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _ParamShape, _ProbsLogits
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.utils import broadcast_all

__all__ = ["NegativeBinomial"]


class NegativeBinomial(_ParamShape, _ProbsLogits):
    """NegativeBinomial(total_count, probs|logits): successes before ``total_count`` failures."""

    arg_constraints = {"total_count": constraints.greater_than_eq(0.0), "probs": constraints.half_open_interval(0.0, 1.0),
                       "logits": constraints.real}
    support = constraints.nonnegative_integer

    def __init__(self, total_count, probs=None, logits=None, validate_args=None):
        self._set_probs_logits(probs, logits)
        param = self._probs_value if self._given == "probs" else self._logits_value
        self.total_count, param = broadcast_all(total_count, param)
        setattr(self, "_probs_value" if self._given == "probs" else "_logits_value", param)
        super().__init__(param.shape, (), validate_args)

    @property
    def _params(self):
        return (self._given, "total_count")

    def _tfp(self):
        return tfd().NegativeBinomial(total_count=self.total_count, logits=self.logits)
