"""LogisticNormal (torch.distributions.logistic_normal)."""

from __future__ import annotations

from tfdist.distributions import constraints
from tfdist.distributions.normal import Normal
from tfdist.distributions.transformed_distribution import TransformedDistribution
from tfdist.distributions.transforms import StickBreakingTransform
from tfdist.distributions.utils import as_shape

__all__ = ["LogisticNormal"]


class LogisticNormal(TransformedDistribution):
    """A Normal over ``K - 1`` dims pushed onto the ``K``-simplex by stick breaking.

    ``loc`` and ``scale`` have ``K - 1`` entries in their last dim; samples
    have ``K`` and lie on the simplex.

    Example::

        d = LogisticNormal(tf.zeros(3), tf.ones(3))
        d.sample().shape        # (4,), summing to 1
    """

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    support = constraints.simplex
    has_rsample = True

    def __init__(self, loc, scale, validate_args=None):
        base = Normal(loc, scale, validate_args=validate_args)
        if not base.batch_shape:
            base = base.expand([1])
        super().__init__(base, StickBreakingTransform(), validate_args=validate_args)

    @property
    def loc(self):
        return self.base_dist.loc

    @property
    def scale(self):
        return self.base_dist.scale

    def expand(self, batch_shape, _instance=None):
        k = self.base_dist.batch_shape[-1:]
        base = self.base_dist.expand(as_shape(batch_shape).concatenate(k))
        return LogisticNormal(base.loc, base.scale)
