"""Exponential with torch's parameterisation (torch.distributions.exponential)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["Exponential"]


Exponential = _one("Exponential", "rate", lambda r: tfd().Exponential(r), constraints.nonnegative,
                   exp_family=True)
