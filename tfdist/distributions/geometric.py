"""Geometric with torch's parameterisation (torch.distributions.geometric)."""

from __future__ import annotations

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

    def _tfp(self):
        return tfd().Geometric(probs=self.probs)
