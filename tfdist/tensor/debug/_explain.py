"""explain_redistribute: the per-mesh-dim plan of a redistribute, without running it."""

from __future__ import annotations

from typing import Sequence

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._api import DTensor, _target_spec
from tfdist.tensor._redistribute import (
    TransformStep,
    check_transition,
    plan_redistribute,
)
from tfdist.tensor.placement_types import Placement

__all__ = ["explain_redistribute"]


def explain_redistribute(
    dtensor: DTensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> list[TransformStep]:
    """The steps ``dtensor.redistribute(device_mesh, placements)`` runs, in order.

    One step per collective, one mesh dim each, with the bytes each device
    sends (``step.bytes_per_device``, ring algorithms); local slices and pads
    are not steps.  What the devices ran is measured by CommDebugMode.

    Example:
        >>> [str(s) for s in explain_redistribute(x, mesh, [Replicate(), Shard(0)])]
        ['dp: S(0) -> R (all_gather)', 'tp: S(1) -> S(0) (all_to_all)']
    """
    if placements is None:
        raise ValueError("explain_redistribute needs placements. Received: placements=None")
    dst = _target_spec(dtensor._spec, device_mesh, placements)
    check_transition(dtensor._spec, dst)
    return plan_redistribute(dtensor._spec, dst, dtensor.dtype.size)
