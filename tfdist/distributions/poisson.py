"""Poisson with torch's parameterisation (torch.distributions.poisson)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["Poisson"]


Poisson = _one("Poisson", "rate", lambda r: tfd().Poisson(rate=r), constraints.nonnegative_integer,
               constraint=constraints.nonnegative, has_rsample=False, exp_family=True)
