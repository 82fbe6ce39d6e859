"""HalfNormal with torch's parameterisation (torch.distributions.half_normal)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._parameterised import _one
from tfdist.distributions._tfp_backed import tfd

__all__ = ["HalfNormal"]


_HalfNormal = _one("HalfNormal", "scale", lambda s: tfd().HalfNormal(s), constraints.nonnegative)


class HalfNormal(_HalfNormal):
    __doc__ = _HalfNormal.__doc__

    def icdf(self, prob):
        """The value below which the distribution puts probability ``prob`` (torch names it ``prob``)."""
        return super().icdf(prob)
