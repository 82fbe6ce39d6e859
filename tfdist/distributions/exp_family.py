"""ExponentialFamily (torch.distributions.exp_family)."""

from __future__ import annotations

from tfdist.distributions._tfp_backed import _TFPBacked

__all__ = ["ExponentialFamily"]


class ExponentialFamily(_TFPBacked):
    """Marker base for exponential-family distributions (torch.distributions.ExponentialFamily)."""
