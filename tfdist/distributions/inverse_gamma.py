"""InverseGamma with torch's parameterisation (torch.distributions.inverse_gamma)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["InverseGamma"]


InverseGamma = _positive_pair("InverseGamma", "InverseGamma", "concentration", "rate", constraints.positive,
                              lambda c, r: {"concentration": c, "scale": r})
