"""Normal with torch's parameterisation (torch.distributions.normal)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["Normal"]


Normal = _two("Normal", "Normal", "loc", "scale", constraints.real, exp_family=True)
