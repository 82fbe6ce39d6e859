"""Redistribute: move a physical TF DTensor from one spec to another.

A transition on one mesh dim maps to one collective (torch's table):

===================  ==================  ====================================
from                 to                  what runs
===================  ==================  ====================================
Shard(d)             Replicate()         all-gather (CollectiveGatherV2)
Shard(i)             Shard(j)            all-to-all
Replicate()          Shard(d)            local slice, no communication
Partial(op)          Replicate()         all-reduce
Partial(op)          Shard(d)            reduce-scatter: an all-to-all of the
                                         stacked Partial axis + a local reduce
===================  ==================  ====================================

As torch structures it, planning and running are apart:

- ``_plan.plan(src, dst, itemsize)`` returns a :class:`~._steps.Plan`, data
  (cached per pair of specs): torch's steps, one collective on one mesh dim
  each with the bytes every device sends, and the physical ops that run
  them.  ``_program`` plans specs with one mesh dim per tensor dim (trying
  each order of steps that can change the bytes); ``_nested`` plans dims
  sharded over several mesh dims.
- ``_execute.run(plan, x)`` applies the ops; ``redistribute_physical`` is
  plan + run.
- ``_moves`` holds the raw relayouts that dodge TF DTensor's mis-lowerings
  (also used for tfdist's own relayouts of Keras tensors); ``_byte_gather``
  the all-gathers of types TF's gather does not carry.

Uneven shards are re-padded on dims that are replicated at that moment,
where padding and slicing are local.
"""

from tfdist.tensor._redistribute._execute import logger, redistribute_physical, run
from tfdist.tensor._redistribute._moves import reduce_scatter_move, relayout, relayout_traced
from tfdist.tensor._redistribute._plan import check_transition, plan, plan_redistribute
from tfdist.tensor._redistribute._steps import Plan, TransformStep

__all__ = ["TransformStep", "Plan", "plan", "run", "plan_redistribute", "redistribute_physical", "relayout",
           "relayout_traced", "check_transition", "reduce_scatter_move", "logger"]
