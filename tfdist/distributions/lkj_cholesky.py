"""LKJCholesky with torch's parameterisation (torch.distributions.lkj_cholesky)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions._tfp_backed import _TFPBacked, tfd
from tfdist.distributions.utils import broadcast_all

__all__ = ["LKJCholesky"]


class LKJCholesky(_TFPBacked):
    """LKJCholesky(dim, concentration=1.0): Cholesky factors of correlation matrices."""

    arg_constraints = {"concentration": constraints.positive}
    support = constraints.corr_cholesky
    _params = ("concentration",)

    def __init__(self, dim, concentration=1.0, validate_args=None):
        if dim < 2:
            raise ValueError(f"Expected dim to be an integer greater than or equal to 2. Found dim={dim}.")
        self.dim = dim
        (self.concentration,) = broadcast_all(concentration)
        super().__init__(self.concentration.shape, (dim, dim), validate_args)

    def _tfp(self):
        return tfd().CholeskyLKJ(dimension=self.dim, concentration=self.concentration)

    def _extra_kwargs(self):
        return {"dim": self.dim}
