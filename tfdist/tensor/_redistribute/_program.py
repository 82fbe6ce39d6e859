"""The planner for specs whose dims are each sharded on one mesh dim at most.

``Program`` tracks a physical tensor's shape and layout while it decides the
steps of a redistribute, one mesh dim per collective (as torch plans it, and
because TF DTensor mis-lowers some relayouts that move several mesh dims at
once), recording torch's steps with bytes and the ops that run them.  Bytes
are ring algorithms': all-gather (k-1) x the local block, all-to-all and
reduce-scatter (k-1)/k x it, all-reduce 2 (k-1)/k x it.  Where the order of
steps matters for the bytes (reducing Partials before or after moving the
shards that block a reduce-scatter), every order is planned and the one
that moves fewest bytes per device wins.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from tensorflow.experimental import dtensor

from tfdist.tensor._layout import DTensorSpec, chunk_size
from tfdist.tensor._redistribute._steps import Gather, Move, Op, Reduce, Relayout, Resize, TransformStep
from tfdist.tensor.placement_types import Placement, Replicate, Shard

__all__ = ["Program", "plan_steps"]


class Program:
    """A redistribute being planned: the physical layout and shape now, the steps and ops so far."""

    def __init__(self, spec: DTensorSpec, itemsize: int) -> None:
        self.root = spec.mesh.root_mesh
        self.shape = spec.shape
        self.placements = list(spec.root_placements)
        self.partial = list(spec.partial_mesh_dims)  # mesh dim of each stacked leading axis
        self.specs = list(spec.tf_layout.sharding_specs)
        self.sizes = list(spec.physical_shape)
        self.itemsize = itemsize
        self.steps: list[TransformStep] = []
        self.ops: list[Op] = []

    # -- bookkeeping ----------------------------------------------------------
    @property
    def lead(self) -> int:
        return len(self.partial)

    @property
    def bytes(self) -> float:
        return sum(s.bytes_per_device for s in self.steps)

    def _k(self, spec: str) -> int:
        return self.root.shape[self.root.axis_names.index(spec)]

    def local_bytes(self) -> float:
        shards = math.prod(self._k(s) for s in self.specs if s != dtensor.UNSHARDED)
        return math.prod(self.sizes) / shards * self.itemsize

    def relayout(self, specs: list[str]) -> None:
        self.specs = list(specs)
        self.ops.append(Relayout(tuple(self.specs)))

    def record(self, m: int, new: Placement, collective: str, sent: float) -> None:
        name = self.root.axis_names[m]
        self.steps.append(TransformStep(name, self.placements[m], new, collective, sent))
        self.placements[m] = new

    # -- local steps ----------------------------------------------------------
    def resize_axis(self, axis: int, n: int) -> None:
        """Pads or slices (at the end) physical ``axis``, which must be whole on every device now."""
        if self.sizes[axis] != n:
            self.sizes[axis] = n
            self.ops.append(Resize(axis, n, tuple(self.specs)))

    def resize(self, d: int, n: int) -> None:
        """``resize_axis`` of logical dim ``d`` (replicated now)."""
        self.resize_axis(self.lead + d, n)

    # -- collectives, one mesh dim each -----------------------------------------
    def all_to_all(self, m: int, b: int, c: int, new: Placement, collective: str = "all_to_all") -> None:
        """Moves mesh dim ``m`` from physical dim ``b`` onto ``c`` (``_moves.move_mesh_dim``)."""
        k = self.root.shape[m]
        sent = (k - 1) / k * self.local_bytes()
        self.ops.append(Move(b, c, tuple(self.specs), reduce_scatter=collective == "reduce_scatter"))
        self.specs[c], self.specs[b] = self.specs[b], dtensor.UNSHARDED
        self.record(m, new, collective, sent)

    def all_gather(self, m: int, b: int) -> None:
        """Unshards physical dim ``b`` (mesh dim ``m``).

        One mesh dim per relayout: with the CollectiveGatherV2 lowering, TF
        DTensor 2.21 fails to compile a relayout that gathers two mesh dims
        at once (docs/tf_dtensor_repros/all_gather_two_mesh_dims.py); torch
        gathers mesh dim by mesh dim too, and the bytes are the same.
        """
        sent = (self.root.shape[m] - 1) * self.local_bytes()
        self.ops.append(Gather(b, tuple(self.specs)))
        self.specs[b] = dtensor.UNSHARDED
        self.record(m, Replicate(), "all_gather", sent)

    def reduce_scatter(self, m: int, d: int) -> None:
        """Partial(op) on mesh dim ``m`` -> Shard(d) on ``m`` with reduce-scatter bytes.

        The Partial values are a leading physical axis sharded on m.  Moving
        m from that axis onto dim d is an all-to-all: each device receives,
        for its own block of d, that block of every device's partial value
        ((k-1)/k of the tensor, as a ring reduce-scatter moves).  Reducing
        the axis is then local.  TF DTensor's own lowering would all-reduce
        the whole tensor and slice.
        """
        axis = self.partial.index(m)
        self.resize(d, chunk_size(self.shape[d], self.root.shape[m]) * self.root.shape[m])  # dim d is replicated: local
        op = self.placements[m].reduce_op
        self.all_to_all(m, axis, self.lead + d, Shard(d), "reduce_scatter")
        self.ops.append(Reduce(op, (axis,)))
        del self.partial[axis], self.sizes[axis], self.specs[axis]
        self.relayout(self.specs)

    def all_reduce(self, mesh_dims: Sequence[int]) -> None:
        """Resolves the Partials on ``mesh_dims``: one all-reduce per reduce op."""
        by_op: dict[str, list[int]] = {}
        for m in mesh_dims:
            by_op.setdefault(self.placements[m].reduce_op, []).append(m)
        for op, dims in by_op.items():
            axes = [self.partial.index(m) for m in dims]
            for axis in sorted(axes, reverse=True):
                del self.partial[axis], self.sizes[axis], self.specs[axis]
            self.ops.append(Reduce(op, tuple(axes)))
            group = math.prod(self.root.shape[m] for m in dims)
            sent = 2 * (group - 1) / group * self.local_bytes()
            for i, m in enumerate(dims):
                self.record(m, Replicate(), "all_reduce", sent if i == 0 else 0.0)
        self.relayout(self.specs)

    # -- the plan -------------------------------------------------------------
    def reduce_scatters(self, want: Sequence[Placement]) -> None:
        while True:
            busy = {p.dim for p in self.placements if isinstance(p, Shard)}
            pick = next(
                (m for m in self.partial
                 if isinstance(want[m], Shard) and want[m].dim not in busy
                 and sum(r.is_shard(want[m].dim) for r in want) == 1),
                None,
            )
            if pick is None:
                return
            self.reduce_scatter(pick, want[pick].dim)

    def move_shards(self, dst: DTensorSpec, only: set[int] | None = None) -> None:
        """Every mesh dim whose Shard changes: an all-gather, or an all-to-all onto its new dim.

        Gathers go first (they free tensor dims), then all-to-alls whose
        target dim is free; a cycle (a full swap) is broken by a gather.
        """
        want = dst.root_placements

        def target(m: int) -> int | None:
            q = want[m]
            if isinstance(q, Shard) and sum(r.is_shard(q.dim) for r in want) == 1:
                return q.dim
            return None

        pending = [
            m for m in range(self.root.ndim)
            if isinstance(self.placements[m], Shard) and self.placements[m] != want[m]
            and (only is None or m in only)
        ]
        while pending:
            gathers = [m for m in pending if target(m) is None]
            busy = {r.dim for r in self.placements if isinstance(r, Shard)}
            moves = [m for m in pending if target(m) is not None and target(m) not in busy]
            # a cycle (a full swap) is broken by gathering the smallest mesh dim
            m = gathers[-1] if gathers else moves[-1] if moves else min(pending, key=lambda i: self.root.shape[i])
            pending.remove(m)
            d = self.placements[m].dim
            if not gathers and moves:
                j = target(m)
                self.resize(j, dst.padded_size(j))  # dim j is replicated now: local
                self.all_to_all(m, self.lead + d, self.lead + j, want[m])
            else:
                self.all_gather(m, self.lead + d)

    def early_slices(self, dst: DTensorSpec) -> None:
        """Replicate -> Shard(j) slices done first (local), so later collectives move less.

        Only onto dims no mesh dim shards now and no Partial or Shard is
        about to move onto.
        """
        want = dst.root_placements
        incoming = {want[m].dim for m, p in enumerate(self.placements)
                    if not p.is_replicate() and isinstance(want[m], Shard) and p != want[m]}
        for m, p in enumerate(self.placements):
            q = want[m]
            busy = {r.dim for r in self.placements if isinstance(r, Shard)}
            if (p.is_replicate() and isinstance(q, Shard) and q.dim not in busy and q.dim not in incoming
                    and sum(r.is_shard(q.dim) for r in want) == 1):
                self.resize(q.dim, dst.padded_size(q.dim))
                specs = list(self.specs)
                specs[self.lead + q.dim] = self.root.axis_names[m]
                self.relayout(specs)
                self.placements[m] = q

    def finish(self, dst: DTensorSpec) -> None:
        """Local pads and slices of the dims not sharded now, then the last (local) shards."""
        sharded = {r.dim for r in self.placements if isinstance(r, Shard)}
        for d in range(len(self.shape)):
            if d not in sharded:
                to_shard = any(r.is_shard(d) for r in dst.root_placements)
                self.resize(d, dst.padded_size(d) if to_shard else dst.shape[d])
        self.placements = list(dst.root_placements)
        self.relayout(list(dst.tf_layout.sharding_specs))


def _blockers(src: DTensorSpec, dst: DTensorSpec) -> set[int]:
    """Mesh dims whose Shard sits on a dim that a Partial mesh dim is to be reduce-scattered onto."""
    want = dst.root_placements
    targets = {want[m].dim for m in src.partial_mesh_dims if isinstance(want[m], Shard)}
    return {
        m for m, p in enumerate(src.root_placements)
        if isinstance(p, Shard) and p.dim in targets and want[m] != p
    }


def _program(src: DTensorSpec, dst: DTensorSpec, itemsize: int, order: tuple[bool, bool]) -> Program:
    slices_first, blockers_first = order
    prog = Program(src, itemsize)
    if slices_first:
        prog.early_slices(dst)
    if blockers_first:
        prog.move_shards(dst, only=_blockers(src, dst))
    prog.reduce_scatters(dst.root_placements)
    prog.all_reduce([m for m in prog.partial if m not in dst.partial_mesh_dims])
    prog.move_shards(dst)
    prog.finish(dst)
    return prog


_ORDERS = ((False, False), (True, False), (False, True), (True, True))


@functools.lru_cache(maxsize=4096)
def plan_steps(src: DTensorSpec, dst: DTensorSpec, itemsize: int) -> Program:
    """The program that sends the fewest bytes: (local slices first?, blocking shards first?),
    the first of equals winning.  ``src`` and ``dst`` shard each dim on one mesh dim at most."""
    return min((_program(src, dst, itemsize, order) for order in _ORDERS), key=lambda prog: prog.bytes)
