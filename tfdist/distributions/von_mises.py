"""VonMises with torch's parameterisation (torch.distributions.von_mises)."""

from __future__ import annotations

import math

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _two

__all__ = ["VonMises"]


VonMises = _two("VonMises", "VonMises", "loc", "concentration", constraints.real,
                has_rsample=False)
