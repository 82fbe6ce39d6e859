"""Timing a plan: when each action would run if every action took a fixed time.

Each rank runs its actions in plan order; an action starts when its rank is
free and what it needs is done (the previous stage's forward of that
microbatch for a forward; this stage's forward and the next stage's input
gradient for a backward).  With forward = 1, backward-input = 1,
backward-weight = 1 and full backward = 2 units this gives the bubble
fraction the schedule literature quotes ((p - 1) / (m + p - 1) for GPipe and
1F1B).
"""

from __future__ import annotations

from tfdist.pipelining._actions import B, F, I, OVERLAP_F_B, REDUCE_GRAD, W, Action

COSTS = {F: 1.0, I: 1.0, W: 1.0, B: 2.0, REDUCE_GRAD: 0.0}


def simulate(order: dict[int, list[Action | None]], num_stages: int,
             costs: dict | None = None) -> dict[int, list[tuple[str, float, float]]]:
    """Per rank, ``(action, start, end)`` of every action of ``order`` under ``costs``: per computation
    type (unit costs by default), or per ``(stage, computation type)`` where a run measured them."""
    costs = costs or COSTS
    queues = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    finished: dict[tuple, float] = {}
    free = {r: 0.0 for r in queues}
    out: dict[int, list[tuple[str, float, float]]] = {r: [] for r in queues}

    def needs(a: Action) -> list[tuple]:
        if a.computation_type == OVERLAP_F_B:
            return [n for sub in a.sub_actions for n in needs(sub)]
        s, k, m = a.stage_index, a.computation_type, a.microbatch_index
        if k == F:
            return [] if s == 0 else [(s - 1, "F", m)]
        if k in (B, I):
            return [(s, "F", m)] + ([] if s == num_stages - 1 else [(s + 1, "dx", m)])
        if k == W:
            return [(s, "dx", m)]
        return [(s, "w", j) for j in range(max((x[2] for x in finished if x[0] == s and x[1] == "w"),
                                               default=-1) + 1)]

    while any(queues.values()):
        best = None
        for r, q in queues.items():
            if not q or any(n not in finished for n in needs(q[0])):
                continue
            start = max([free[r]] + [finished[n] for n in needs(q[0])])
            if best is None or start < best[1]:
                best = (r, start)
        if best is None:
            raise RuntimeError(f"plan cannot proceed: heads {[str(q[0]) for q in queues.values() if q]}")
        r, start = best
        a = queues[r].pop(0)
        parts = a.sub_actions if a.computation_type == OVERLAP_F_B else (a,)
        # no compute/communication overlap modelled
        end = start + sum(costs.get((p.stage_index, p.computation_type), costs.get(p.computation_type, 0.0))
                          for p in parts)
        free[r] = end
        for p in parts:
            s, k, m = p.stage_index, p.computation_type, p.microbatch_index
            if k == F:
                finished[(s, "F", m)] = end
            if k in (B, I):
                finished[(s, "dx", m)] = end
            if k in (B, W):
                finished[(s, "w", m)] = end
        out[r].append((str(a), start, end))
    return out


def bubble_fraction(timeline: dict[int, list[tuple[str, float, float]]]) -> float:
    """Idle share of the ranks' time from the first action to the last (averaged over ranks)."""
    end = max(e for acts in timeline.values() for _, _, e in acts)
    busy = sum(e - s for acts in timeline.values() for _, s, e in acts)
    return 1.0 - busy / (end * len(timeline))
