"""Laplace with torch's parameterisation (torch.distributions.laplace)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["Laplace"]


Laplace = _two("Laplace", "Laplace", "loc", "scale", constraints.real)
