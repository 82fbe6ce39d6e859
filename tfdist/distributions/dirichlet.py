"""Dirichlet with torch's parameterisation (torch.distributions.dirichlet)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import tfd
from tfdist.distributions.exp_family import ExponentialFamily
from tfdist.distributions.utils import broadcast_all

__all__ = ["Dirichlet"]


class Dirichlet(ExponentialFamily):
    """Dirichlet(concentration)."""

    arg_constraints = {"concentration": constraints.independent(constraints.positive, 1)}
    support = constraints.simplex
    has_rsample = True
    _params = ("concentration",)
    _param_event_ndims = {"concentration": 1}

    def __init__(self, concentration, validate_args=None):
        (self.concentration,) = broadcast_all(concentration)
        if self.concentration.shape.rank < 1:
            raise ValueError("`concentration` parameter must be at least one-dimensional.")
        super().__init__(self.concentration.shape[:-1], self.concentration.shape[-1:], validate_args)

    def _tfp(self):
        return tfd().Dirichlet(self.concentration)
