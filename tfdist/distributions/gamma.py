"""Gamma with torch's parameterisation (torch.distributions.gamma)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Gamma"]


Gamma = _positive_pair("Gamma", "Gamma", "concentration", "rate", constraints.nonnegative,
                       lambda c, r: {"concentration": c, "rate": r}, exp_family=True)
