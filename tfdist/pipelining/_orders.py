"""The plans (``pipeline_order``) of each schedule: for every pipeline rank, its action per time step.

Each function gives, for one rank, the same list torch.distributed.pipelining
builds (tests compare against orders generated with torch, committed as JSON).
The single-stage schedules' plans are torch's after its REDUCE_GRAD pass,
which drops idle steps and appends ``<stage>REDUCE_GRAD`` after a stage's last
backward.
"""

from __future__ import annotations

from collections import defaultdict

from tfdist.pipelining._actions import B, F, REDUCE_GRAD, W, Action

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


def interleaved_1f1b(rank: int, pp: int, n_local: int, n: int) -> Order:
    """Depth first over the rank's stages, one forward one backward in the steady state."""
    per_round = interleaved_rounds(pp, n)
    warmup = min((n_local - 1) * per_round + 2 * (pp - 1 - rank), n * n_local)
    total = n * n_local + warmup  # warm-up forwards, steady pairs, cool-down backwards
    steady_end = n * n_local  # warmup + (microbatch ops - warmup)
    after_warmup = (n_local * pp + 2 * (pp - 1 - rank)) - (warmup + rank)

    def forward_stage(op: int) -> int:
        return ((op // per_round) % n_local) * pp + rank

    def backward_stage(op: int) -> int:
        return (n_local - 1 - ((op - warmup) // per_round) % n_local) * pp + rank

    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)

    def next_mb(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    actions: Order = [None] * rank
    for op in range(total):
        if op < warmup:
            s = forward_stage(op)
            actions.append(Action(s, F, next_mb(fwd_mb, s)))
            if op == warmup - 1:
                actions += [None] * after_warmup
        elif op < steady_end:
            s, t = forward_stage(op), backward_stage(op)
            actions += [Action(s, F, next_mb(fwd_mb, s)), Action(t, B, next_mb(bwd_mb, t))]
        else:
            t = backward_stage(op)
            actions += [None, Action(t, B, next_mb(bwd_mb, t))]
    return actions
