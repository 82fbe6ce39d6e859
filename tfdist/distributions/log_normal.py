"""LogNormal with torch's parameterisation (torch.distributions.log_normal)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["LogNormal"]


LogNormal = _two("LogNormal", "LogNormal", "loc", "scale", constraints.positive)
