"""Chi2 with torch's parameterisation (torch.distributions.chi2)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["Chi2"]


Chi2 = _one("Chi2", "df", lambda df: tfd().Chi2(df), constraints.nonnegative)
