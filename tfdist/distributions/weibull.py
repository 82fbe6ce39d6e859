"""Weibull with torch's parameterisation (torch.distributions.weibull)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Weibull"]


Weibull = _positive_pair("Weibull", "Weibull", "scale", "concentration", constraints.positive,
                         lambda s, k: {"concentration": k, "scale": s})
