"""Sharding propagation: for an op, the input placements it runs on and the output's.

Rules work on *root* placements (one per root mesh dim) and logical shapes.
Each returns ``(input_targets, output_placements)``; the dispatcher
redistributes the inputs to the targets, runs the TF op on the physical
tensors and pins the output layout.  The rules are chosen to agree with the
layout TF DTensor itself propagates, so pinning costs nothing; in
particular a matmul whose contraction dim is sharded gives a *Replicate*
result (TF DTensor all-reduces inside the op), where torch would give Partial.

Uneven shards carry padding (see ``_layout``), which is harmless wherever the
op keeps rows apart (elementwise, matmul's free dims, transpose) and wrong
where it mixes them (contraction, reduction, reshape): there the rule asks
for the dim to be replicated first.
"""

from __future__ import annotations

from typing import Sequence

from tfdist.tensor._layout import DTensorSpec
from tfdist.tensor.placement_types import Placement, Replicate, Shard

__all__ = [
    "Strategy",
    "elementwise_strategy",
    "matmul_strategy",
    "reduction_strategy",
    "transpose_strategy",
    "reshape_strategy",
    "keep_dims_strategy",
]

Placements = tuple[Placement, ...]
Strategy = tuple[list[Placements], Placements]


def _no_partial(p: Placement) -> Placement:
    return Replicate() if p.is_partial() else p


def broadcast_shape(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, n in enumerate(s):
            j = rank - len(s) + i
            if n != 1:
                if out[j] not in (1, n):
                    raise ValueError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[j] = n
    return tuple(out)


def elementwise_strategy(specs: Sequence[DTensorSpec], out_shape: Sequence[int]) -> Strategy:
    """Follows the first operand that shards a (non-broadcast) output dim per mesh dim."""
    rank = len(out_shape)
    n_mesh = len(specs[0].root_placements)
    out: list[Placement] = [Replicate()] * n_mesh
    used: set[int] = set()
    for m in range(n_mesh):
        for spec in specs:
            p = spec.root_placements[m]
            if isinstance(p, Shard):
                d_out = p.dim + rank - len(spec.shape)
                if spec.shape[p.dim] == out_shape[d_out] and d_out not in used:
                    out[m] = Shard(d_out)
                    used.add(d_out)
                    break
    targets = []
    for spec in specs:
        offset = rank - len(spec.shape)
        target = []
        for p in out:
            d_in = p.dim - offset if isinstance(p, Shard) else -1
            full = d_in >= 0 and spec.shape[d_in] == out_shape[p.dim]
            target.append(Shard(d_in) if full else Replicate())
        targets.append(tuple(target))
    return targets, tuple(out)


def matmul_strategy(
    a: DTensorSpec, b: DTensorSpec, transpose_a: bool, transpose_b: bool
) -> tuple[Strategy, tuple[int, ...]]:
    """Megatron-style rules for ``a @ b`` (batch dims broadcast like numpy).

    Per mesh dim, in order of preference: a sharded contraction dim (the
    other operand is sliced to match; the result is Replicate), then a's
    row or batch dim, then b's column or batch dim.
    """
    ra, rb = len(a.shape), len(b.shape)
    a_m, a_k = (ra - 1, ra - 2) if transpose_a else (ra - 2, ra - 1)
    b_k, b_n = (rb - 1, rb - 2) if transpose_b else (rb - 2, rb - 1)
    batch = broadcast_shape([a.shape[:-2], b.shape[:-2]])
    out_shape = batch + (a.shape[a_m], b.shape[b_n])
    ro = len(out_shape)
    n_mesh = len(a.root_placements)
    out: list[Placement] = [Replicate()] * n_mesh
    used_out: set[int] = set()
    lhs = _MatmulOperand(a, a_k, ro - 2, a_m, n_mesh)
    rhs = _MatmulOperand(b, b_k, ro - 1, b_n, n_mesh)

    def give_free_dim(m: int, p: Placement, own: _MatmulOperand, other: _MatmulOperand) -> bool:
        """Gives mesh dim ``m`` to ``own``'s sharded row/column or batch dim, if it can."""
        if not isinstance(p, Shard) or p.dim == own.k_dim:
            return False
        d_out = own.out_dim if p.dim == own.free_dim else own.batch_out_dim(p.dim, out_shape)
        if d_out is None or d_out in used_out:
            return False
        own.targets[m], out[m] = p, Shard(d_out)
        own.used.add(p.dim)
        used_out.add(d_out)
        if d_out < ro - 2:  # a batch dim: the other operand shards it too
            d_other = other.batch_in_dim(d_out, out_shape)
            if d_other is not None:
                other.targets[m] = Shard(d_other)
                other.used.add(d_other)
        return True

    for m in range(n_mesh):
        pa, pb = _no_partial(a.root_placements[m]), _no_partial(b.root_placements[m])
        if (pa.is_shard(a_k) or pb.is_shard(b_k)) and a_k not in lhs.used and b_k not in rhs.used \
                and a.shape[a_k] % a.root_shape[m] == 0:
            lhs.targets[m], rhs.targets[m] = Shard(a_k), Shard(b_k)
            lhs.used.add(a_k)
            rhs.used.add(b_k)
            continue
        # a's row/batch dim, else b's column/batch dim, carries over to the output
        if not give_free_dim(m, pa, lhs, rhs):
            give_free_dim(m, pb, rhs, lhs)
    return ([tuple(lhs.targets), tuple(rhs.targets)], tuple(out)), out_shape


class _MatmulOperand:
    """One matmul operand while mesh dims are handed out: its contracted, free and output dims."""

    def __init__(self, spec: DTensorSpec, k_dim: int, out_dim: int, free_dim: int, n_mesh: int) -> None:
        self.spec, self.k_dim, self.out_dim, self.free_dim = spec, k_dim, out_dim, free_dim
        self.targets: list[Placement] = [Replicate()] * n_mesh
        self.used: set[int] = set()

    def batch_out_dim(self, d: int, out_shape: tuple[int, ...]) -> int | None:
        """Output dim of batch dim ``d`` (None unless a full-size batch dim)."""
        rank, ro = len(self.spec.shape), len(out_shape)
        if d >= rank - 2:
            return None
        d_out = d + (ro - 2) - (rank - 2)
        return d_out if self.spec.shape[d] == out_shape[d_out] else None

    def batch_in_dim(self, d_out: int, out_shape: tuple[int, ...]) -> int | None:
        """This operand's dim for output batch dim ``d_out`` (None if broadcast)."""
        d = d_out - (len(out_shape) - 2) + (len(self.spec.shape) - 2)
        return d if d >= 0 and self.spec.shape[d] == out_shape[d_out] else None


def reduction_strategy(spec: DTensorSpec, axes: Sequence[int], keepdims: bool) -> Strategy:
    """Reduced dims come out replicated (an all-reduce); uneven ones are gathered first."""
    reduced = set(axes)
    target, out = [], []
    for m, p in enumerate(spec.root_placements):
        p = _no_partial(p)
        if isinstance(p, Shard) and p.dim in reduced:
            target.append(p if p.dim not in spec.uneven_dims else Replicate())
            out.append(Replicate())
        elif isinstance(p, Shard):
            shift = 0 if keepdims else sum(1 for a in reduced if a < p.dim)
            target.append(p)
            out.append(Shard(p.dim - shift))
        else:
            target.append(Replicate())
            out.append(Replicate())
    return [tuple(target)], tuple(out)


def keep_dims_strategy(spec: DTensorSpec, mixed_dims: Sequence[int]) -> Strategy:
    """Ops that mix rows along ``mixed_dims`` (softmax): those dims are replicated."""
    mixed = set(mixed_dims)
    target = tuple(
        Replicate() if p.is_partial() or (isinstance(p, Shard) and p.dim in mixed) else p
        for p in spec.root_placements
    )
    return [target], target


def transpose_strategy(spec: DTensorSpec, perm: Sequence[int]) -> Strategy:
    perm = list(perm)
    target = tuple(_no_partial(p) for p in spec.root_placements)
    out = tuple(Shard(perm.index(p.dim)) if isinstance(p, Shard) else p for p in target)
    return [target], out


def reshape_strategy(spec: DTensorSpec, new_shape: Sequence[int]) -> Strategy:
    """A sharded dim survives when it maps to one output dim of the same size
    with the same number of elements before it; otherwise it is gathered."""
    old = list(spec.shape)
    new = list(new_shape)

    def prefix(shape: list[int], d: int) -> int:
        out = 1
        for n in shape[:d]:
            out *= n
        return out

    target, out = [], []
    for p in spec.root_placements:
        p = _no_partial(p)
        kept = None
        if isinstance(p, Shard) and p.dim not in spec.uneven_dims:
            before = prefix(old, p.dim)
            for d in range(len(new)):
                if new[d] == old[p.dim] and prefix(new, d) == before:
                    kept = d
                    break
        target.append(p if kept is not None else Replicate())
        out.append(Shard(kept) if kept is not None else Replicate())
    return [tuple(target)], tuple(out)
