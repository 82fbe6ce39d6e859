"""Beta with torch's parameterisation (torch.distributions.beta)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Beta"]


Beta = _positive_pair("Beta", "Beta", "concentration1", "concentration0", constraints.unit_interval,
                      lambda a, b: {"concentration1": a, "concentration0": b}, exp_family=True)
