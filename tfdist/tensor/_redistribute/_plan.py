"""The redistribute planner: from a source and a target spec to a :class:`Plan` (data, cached)."""

from __future__ import annotations

import functools

from tfdist.tensor._layout import DTensorSpec
from tfdist.tensor._redistribute._nested import collapse, expand, ride_target
from tfdist.tensor._redistribute._program import plan_steps
from tfdist.tensor._redistribute._steps import Plan, TransformStep
from tfdist.tensor.placement_types import Partial

__all__ = ["plan", "plan_redistribute", "check_transition"]


def check_transition(src: DTensorSpec, dst: DTensorSpec) -> None:
    """Refuses what torch refuses: creating Partial by redistribute."""
    for m, (a, b) in enumerate(zip(src.root_placements, dst.root_placements)):
        if isinstance(b, Partial) and a != b:
            raise ValueError(
                f"redistributing to {b!r} on mesh dim "
                f"{src.mesh.root_mesh.axis_names[m]!r} is not supported (from {a!r}); "
                "Partial only comes from operators or DTensor.from_local. "
                f"Received: placements={dst.placements!r}"
            )


@functools.lru_cache(maxsize=4096)
def plan(src: DTensorSpec, dst: DTensorSpec, itemsize: int) -> Plan:
    """How a tensor of ``itemsize``-byte elements moves from ``src`` to ``dst``.

    A dim sharded over several mesh dims is first gathered on its inner mesh
    dims (or moved straight to where ``dst`` shards) and, in the target,
    sharded on them last by a local gather and slice: in between it is
    sharded on its outermost one.
    """
    mesh = src.mesh.root_mesh.to_tf()
    if src.root_placements == dst.root_placements:
        return Plan(mesh, (), ())
    steps, ops = [], []
    if src.multi_dims:
        src, steps, ops = collapse(src, dst, itemsize)
    inner = ride_target(src, dst) if dst.multi_dims else dst
    program = plan_steps(src, inner, itemsize)
    steps, ops = steps + program.steps, ops + program.ops
    if dst.multi_dims:
        last_steps, last_ops = expand(inner, dst, itemsize)
        steps, ops = steps + last_steps, ops + last_ops
    return Plan(mesh, tuple(steps), tuple(ops))


def plan_redistribute(src: DTensorSpec, dst: DTensorSpec, itemsize: int = 4) -> list[TransformStep]:
    """The steps a redistribute runs, each with its collective and bytes per device."""
    return list(plan(src, dst, itemsize).steps)
