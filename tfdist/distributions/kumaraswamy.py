"""Kumaraswamy with torch's parameterisation (torch.distributions.kumaraswamy)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _positive_pair

__all__ = ["Kumaraswamy"]


Kumaraswamy = _positive_pair("Kumaraswamy", "Kumaraswamy", "concentration1", "concentration0",
                             constraints.unit_interval, lambda a, b: {"concentration1": a, "concentration0": b})
