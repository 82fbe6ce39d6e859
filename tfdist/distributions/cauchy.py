"""Cauchy with torch's parameterisation (torch.distributions.cauchy)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["Cauchy"]


Cauchy = _two("Cauchy", "Cauchy", "loc", "scale", constraints.real)
