"""biject_to / transform_to: from a constraint to a transform whose codomain it is."""

from __future__ import annotations

from typing import Callable

from tfdist.distributions import constraints
from tfdist.distributions import transforms as T

__all__ = ["ConstraintRegistry", "biject_to", "transform_to"]


class ConstraintRegistry:
    """Maps constraint types (or instances) to factories ``factory(constraint) -> Transform``."""

    def __init__(self) -> None:
        self._registry: dict[type, Callable] = {}

    def register(self, constraint, factory: Callable | None = None):
        if factory is None:
            return lambda f: self.register(constraint, f)
        key = constraint if isinstance(constraint, type) else type(constraint)
        if not issubclass(key, constraints.Constraint):
            raise TypeError(f"Expected constraint to be a Constraint subclass or instance, got {constraint}")
        self._registry[key] = factory
        return factory

    def __call__(self, constraint) -> T.Transform:
        for cls in type(constraint).__mro__:
            if cls in self._registry:
                return self._registry[cls](constraint)
        raise NotImplementedError(f"Cannot transform {type(constraint).__name__} constraints")


biject_to = ConstraintRegistry()
transform_to = ConstraintRegistry()

for registry in (biject_to, transform_to):
    registry.register(type(constraints.real), lambda c: T.identity_transform)
    registry.register(type(constraints.positive), lambda c: T.ComposeTransform(
        [T.ExpTransform(), T.AffineTransform(c.lower_bound, 1.0)]))
    registry.register(type(constraints.less_than(0.0)), lambda c: T.ComposeTransform(
        [T.ExpTransform(), T.AffineTransform(c.upper_bound, -1.0)]))
    registry.register(type(constraints.unit_interval), lambda c: T.ComposeTransform(
        [T.SigmoidTransform(), T.AffineTransform(c.lower_bound, c.upper_bound - c.lower_bound)]))
    registry.register(type(constraints.real_vector), lambda c, reg=registry: T.IndependentTransform(
        reg(c.base_constraint), c.reinterpreted_batch_ndims))

biject_to.register(type(constraints.simplex), lambda c: T.StickBreakingTransform())
transform_to.register(type(constraints.simplex), lambda c: T.SoftmaxTransform())
transform_to.register(type(constraints.lower_cholesky), lambda c: T.LowerCholeskyTransform())

for registry in (biject_to, transform_to):
    registry.register(type(constraints.corr_cholesky), lambda c: T.CorrCholeskyTransform())
    registry.register(constraints.cat, lambda c, reg=registry: T.CatTransform(
        [reg(sub) for sub in c.cseq], c.dim, c.lengths))
    registry.register(constraints.stack, lambda c, reg=registry: T.StackTransform(
        [reg(sub) for sub in c.cseq], c.dim))
transform_to.register(type(constraints.positive_definite), lambda c: T.PositiveDefiniteTransform())
transform_to.register(type(constraints.positive_semidefinite), lambda c: T.PositiveDefiniteTransform())
