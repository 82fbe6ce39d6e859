"""The plans (``pipeline_order``) of each schedule: for every pipeline rank, its action per time step.

Each function gives, for one rank, the same list torch.distributed.pipelining
builds (tests compare against orders generated with torch, committed as JSON).
The single-stage schedules' plans are torch's after its REDUCE_GRAD pass,
which drops idle steps and appends ``<stage>REDUCE_GRAD`` after a stage's last
backward.
"""

from __future__ import annotations

from collections import defaultdict

from tfdist.pipelining._actions import B, F, I, OVERLAP_F_B, REDUCE_GRAD, W, Action

Order = list  # of Action | None


def with_reduce_grad(actions: Order, n_microbatches: int) -> Order:
    """Idle steps dropped; ``REDUCE_GRAD`` after the n-th backward of each stage."""
    out: Order = []
    seen: dict[int, int] = defaultdict(int)
    for a in actions:
        if a is None:
            continue
        out.append(a)
        if a.computation_type in (B, W):
            seen[a.stage_index] += 1
            if seen[a.stage_index] == n_microbatches:
                out.append(Action(a.stage_index, REDUCE_GRAD, None))
    return out


def gpipe(rank: int, pp: int, n: int) -> Order:
    """All forwards, then all backwards."""
    actions: Order = [None] * rank + [Action(rank, F, m) for m in range(n)]
    actions += [None] * (3 * (pp - 1 - rank)) + [Action(rank, B, m) for m in range(n)]
    return with_reduce_grad(actions, n)


def one_f_one_b_plan(rank: int, pp: int, n: int) -> Order:
    """torch's published 1F1B plan, kept identical for comparison.

    torch 2.13 numbers the steady-state forwards from the last warm-up one, so
    the last rank (no warm-up) is planned as F1..Fn instead of F0..Fn-1; torch
    executes 1F1B from its own loop, not from this plan, and so does tfdist
    (:func:`one_f_one_b_execution`).
    """
    actions: Order = [None] * rank
    warm = (pp - 1) - rank
    forward_mb = 0
    for i in range(warm):
        actions.append(Action(rank, F, i))
        forward_mb = i
    actions += [None] * max(0, 2 * (pp - 1 - rank))
    backward_mb, remaining = 0, n - warm
    while remaining > 0:
        forward_mb += 1
        actions += [Action(rank, F, forward_mb), Action(rank, B, backward_mb)]
        backward_mb += 1
        remaining -= 1
    while n - backward_mb > 0:
        actions += [None, Action(rank, B, backward_mb)]
        backward_mb += 1
    return with_reduce_grad(actions, n)


def one_f_one_b_plan_as_run(rank: int, pp: int, n: int) -> Order:
    """torch's 1F1B plan, time steps and all, with the microbatch numbers the run executes: a rank
    without warm-up forwards (the last) runs F0..Fn-1 where torch's plan says F1..Fn."""
    plan = one_f_one_b_plan(rank, pp, n)
    if pp - 1 - rank > 0:
        return plan
    return [Action(a.stage_index, F, a.microbatch_index - 1) if a is not None and a.computation_type == F else a
            for a in plan]


def one_f_one_b_execution(rank: int, pp: int, n: int) -> Order:
    """What 1F1B runs: ``pp - 1 - rank`` warm-up forwards, then one forward one backward, then the rest."""
    warm = min(pp - 1 - rank, n)
    actions: Order = [Action(rank, F, m) for m in range(warm)]
    f, b = warm, 0
    while f < n:
        actions += [Action(rank, F, f), Action(rank, B, b)]
        f, b = f + 1, b + 1
    actions += [Action(rank, B, m) for m in range(b, n)]
    return with_reduce_grad(actions, n)


def looped_bfs(rank: int, pp: int, n_local: int, n: int) -> Order:
    """Breadth first: every microbatch through the rank's earlier stage before its later one."""
    stages = range(rank, pp * n_local, pp)
    actions: Order = [None] * rank
    for s in stages:
        actions += [Action(s, F, m) for m in range(n)]
    actions += [None] * (2 * (pp - 1 - rank))
    for s in reversed(stages):
        actions += [Action(s, B, m) for m in reversed(range(n))]
    return actions


def interleaved_rounds(pp: int, n: int) -> int:
    """Microbatches per round of the interleaved schedules (checks that rounds divide ``n``)."""
    rounds = max(1, n // pp)
    if n % rounds:
        raise ValueError(
            f"n_microbatches={n}: the interleaved schedules run max(1, n_microbatches // pp)={rounds} rounds "
            f"and need n_microbatches to be a multiple of it (pp={pp})."
        )
    return n // rounds


def interleaved(rank: int, pp: int, n_local: int, n: int, zero_bubble: bool = False) -> Order:
    """Depth first over the rank's stages, one forward one backward in the steady state.

    ``zero_bubble``: the backward is split into its input part (``I``, on the
    critical path) and weight part (``W``), and the weight parts fill what
    would be idle steps (warm-up of one forward per hop instead of two; a rank
    starts deferring ``W`` after ``rank`` steady pairs).
    """
    per_round = interleaved_rounds(pp, n)
    hop = 1 if zero_bubble else 2
    warmup = min((n_local - 1) * per_round + hop * (pp - 1 - rank), n * n_local)
    total = n * n_local + warmup  # warm-up forwards, steady pairs, cool-down backwards
    steady_end = n * n_local
    after_warmup = (pp - rank - 1) if zero_bubble else (n_local * pp + 2 * (pp - 1 - rank)) - (warmup + rank)
    backward_kind = I if zero_bubble else B

    def forward_stage(op: int) -> int:
        return ((op // per_round) % n_local) * pp + rank

    def backward_stage(op: int) -> int:
        return (n_local - 1 - ((op - warmup) // per_round) % n_local) * pp + rank

    counters: dict[str, dict[int, int]] = {"F": defaultdict(int), "B": defaultdict(int), "W": defaultdict(int)}

    def act(kind, stage: int) -> Action:
        key = "F" if kind == F else "W" if kind == W else "B"
        counters[key][stage] += 1
        return Action(stage, kind, counters[key][stage] - 1)

    actions: Order = [None] * rank
    backward_ops: list[int] = []
    weights_done = 0

    def deferred_weight(op: int) -> None:
        nonlocal weights_done
        if zero_bubble and op - warmup >= rank:
            actions.append(act(W, backward_stage(backward_ops[weights_done])))
            weights_done += 1

    for op in range(total):
        if op < warmup:
            actions.append(act(F, forward_stage(op)))
            if op == warmup - 1:
                actions += [None] * after_warmup
        elif op < steady_end:
            actions += [act(F, forward_stage(op)), act(backward_kind, backward_stage(op))]
            backward_ops.append(op)
            deferred_weight(op)
        else:
            if not zero_bubble:
                actions.append(None)
            actions.append(act(backward_kind, backward_stage(op)))
            backward_ops.append(op)
            deferred_weight(op)
    while zero_bubble and weights_done < len(backward_ops):
        actions.append(act(W, backward_stage(backward_ops[weights_done])))
        weights_done += 1
    return actions


def interleaved_1f1b(rank: int, pp: int, n_local: int, n: int) -> Order:
    return interleaved(rank, pp, n_local, n, zero_bubble=False)


def with_forward_bubbles(plans: dict[int, Order], num_stages: int) -> dict[int, Order]:
    """Steps the ranks' plans together, inserting an idle step wherever a forward would run before
    the previous stage's forward of that microbatch ran in an earlier step (torch's bubble pass of
    the interleaved zero-bubble schedule)."""
    seen: set[tuple[int, object, int]] = set()
    out: dict[int, Order] = {r: [] for r in plans}
    pointer = {r: 0 for r in plans}
    while True:
        active = False
        now: set[tuple[int, object, int]] = set()
        for r in sorted(plans):
            if pointer[r] >= len(plans[r]):
                continue
            active = True
            a = plans[r][pointer[r]]
            if a is None:
                out[r].append(None)
                pointer[r] += 1
                continue
            blocked = a.computation_type == F and a.stage_index != 0 and \
                (a.stage_index - 1, F, a.microbatch_index) not in seen
            blocked = blocked or (a.computation_type == B and (
                (a.stage_index, F, a.microbatch_index) not in seen if a.stage_index == num_stages - 1
                else (a.stage_index + 1, B, a.microbatch_index) not in seen))
            if blocked:
                out[r].append(None)
            else:
                out[r].append(a)
                if a.microbatch_index is not None:
                    now.add((a.stage_index, a.computation_type, a.microbatch_index))
                pointer[r] += 1
        seen |= now
        if not active:
            return out


def interleaved_zero_bubble(pp: int, n_local: int, n: int) -> dict[int, Order]:
    plans = {r: interleaved(r, pp, n_local, n, zero_bubble=True) for r in range(pp)}
    return with_forward_bubbles(plans, pp * n_local)


def zbv(rank: int, pp: int, n: int) -> Order:
    """The V-shaped zero-bubble schedule: rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``."""
    n_micro = max(2 * pp - 1, n)
    first, second = rank, 2 * pp - 1 - rank
    count = {k: 0 for k in ("f0", "f1", "b0", "b1")}
    actions: Order = [None] * rank

    def add(stage: int, kind, key: str | None, mb: int | None = None) -> None:
        if key is not None:
            mb = count[key]
            count[key] += 1
        actions.append(Action(stage, kind, mb))

    for _ in range(2 * (pp - rank) - 1):
        add(first, F, "f0")
    for _ in range(rank):
        add(second, F, "f1")
        add(first, F, "f0")
    for _ in range(pp - rank):
        add(second, F, "f1")
        b = count["b1"]
        add(second, I, "b1")
        add(second, W, None, b)
    while count["f1"] < count["f0"] or count["f0"] < n_micro:
        if count["f0"] < n_micro:
            add(first, F, "f0")
        b = count["b0"]
        add(first, I, "b0")
        add(first, W, None, b)
        add(second, F, "f1")
        b = count["b1"]
        add(second, I, "b1")
        add(second, W, None, b)
    w0, w1 = count["b0"], count["b1"]
    for _ in range(rank):
        add(first, I, "b0")
        add(second, I, "b1")
    for _ in range(pp - rank):
        add(first, I, "b0")
        add(first, W, None, w0)
        w0 += 1
    while w1 < count["b1"]:
        add(second, W, None, w1)
        w1 += 1
    while w0 < count["b0"]:
        add(first, W, None, w0)
        w0 += 1
    # a plan for at least 2 pp - 1 microbatches, the ones past n dropped (idle)
    return [a if a is not None and a.microbatch_index is not None and a.microbatch_index < n else None
            for a in actions]


def dualpipe_v(rank: int, pp: int, n: int) -> Order:
    """DeepSeek's DualPipeV (V-shaped: rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``): in the
    middle phase each step pairs one stage's forward with the other stage's backward
    (``OVERLAP_F_B``), so one's compute hides the other's communication."""
    first, second = rank, 2 * pp - 1 - rank
    count: dict[tuple[int, object], int] = defaultdict(int)
    pending_weights: list[tuple[int, int]] = []
    actions: Order = []

    def add(stage: int, kind) -> Action:
        key = (stage, I if kind == B else kind)
        action = Action(stage, kind, count[key])
        count[key] += 1
        if kind == B:  # a full backward also does the weight part
            count[(stage, W)] += 1
        elif kind == I:
            pending_weights.append((stage, action.microbatch_index))
        return action

    def overlap(forward_stage: int, backward_stage: int) -> None:
        actions.append(Action(-1, OVERLAP_F_B, None, (add(forward_stage, F), add(backward_stage, B))))

    def weight_if_pending() -> None:
        if pending_weights:
            stage, mb = pending_weights.pop(0)
            actions.append(Action(stage, W, mb))
            count[(stage, W)] += 1

    for _ in range((pp - rank - 1) * 2):
        actions.append(add(first, F))
    for _ in range(rank + 1):
        actions += [add(first, F), add(second, F)]
    for _ in range(pp - rank - 1):
        actions.append(add(second, I))
        weight_if_pending()
        actions.append(add(second, F))
    for i in range(n - pp * 2 + rank + 1):
        if i == 0 and rank == pp - 1:
            actions += [add(first, F), add(second, B)]
        else:
            overlap(first, second)
        overlap(second, first)
    for _ in range(pp - rank - 1):
        actions.append(add(second, B))
        overlap(second, first)
    zero_bubble = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zero_bubble = True
        actions.append(add(second, I if zero_bubble else B))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zero_bubble = True
        actions.append(add(first, I if zero_bubble else B))
    for _ in range(pp - rank - 1):
        weight_if_pending()
        actions.append(add(first, I if zero_bubble else B))
    for _ in range(rank + 1):
        weight_if_pending()
    return actions

