"""Gumbel with torch's parameterisation (torch.distributions.gumbel)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["Gumbel"]


Gumbel = _two("Gumbel", "Gumbel", "loc", "scale", constraints.real)
