"""Planning for tensor dims sharded over several mesh dims (torch's nested shards).

Physically such a dim is several axes: the outer mesh dim's pieces, each
inner mesh dim's, then the padded leaf chunk.  A redistribute first
*collapses* the source to "each nested dim sharded on its outermost mesh dim
only" (the form the one-mesh-dim planner in ``_program`` handles), and in
the end *expands* into the target's nested form.  Both put each device's
leaves in order with a local gather of rows (``GatherPieces``); the inner
mesh dims move with one all-to-all, reduce-scatter or all-gather each, as
torch's do.
"""

from __future__ import annotations

import dataclasses
import math

from tensorflow.experimental import dtensor

from tfdist.tensor._layout import DTensorSpec, chunk_size
from tfdist.tensor._redistribute._program import Program
from tfdist.tensor._redistribute._steps import GatherPieces, Merge, Move, Op, Reduce, Relayout, Resize, Split, TransformStep
from tfdist.tensor.placement_types import Shard

__all__ = ["collapse", "ride_target", "expand"]

U = dtensor.UNSHARDED


def physical_start(spec: DTensorSpec, d: int) -> int:
    return len(spec.partial_mesh_dims) + sum(spec.physical_dims(i) for i in range(d))


def collapse(src: DTensorSpec, dst: DTensorSpec, itemsize: int) -> tuple[DTensorSpec, list[TransformStep], list[Op]]:
    """Dims sharded over several mesh dims -> sharded on the outermost one only.

    Each inner mesh dim either all-to-alls straight onto the dim ``dst``
    shards with it (when that dim is free; torch's move) or is all-gathered;
    then a local gather puts each device's leaves back in the order of its
    outer piece.  Returns the collapsed spec, torch's steps and the ops.
    """
    prog = Program(src, itemsize)
    placements = list(src.outer_only().root_placements)
    for d in src.multi_dims:
        start = physical_start(src, d)
        for i, m in reversed(list(enumerate(src.shard_groups[d]))[1:]):
            q = dst.root_placements[m]
            busy = {p.dim for p in placements if isinstance(p, Shard)} | set(src.multi_dims)
            if isinstance(q, Shard) and q.dim not in busy and sum(r.is_shard(q.dim) for r in dst.root_placements) == 1:
                j = physical_start(src, q.dim)  # a single, replicated dim: padding it is local
                prog.resize_axis(j, chunk_size(src.shape[q.dim], src.root_shape[m]) * src.root_shape[m])
                prog.all_to_all(m, start + i, j, q)
                placements[m] = q
            else:
                prog.all_gather(m, start + i)
            prog.steps[-1] = dataclasses.replace(prog.steps[-1], src=Shard(d))
    new = DTensorSpec(src.mesh.root_mesh, tuple(placements), src.shape)
    ops, specs = prog.ops, list(prog.specs)
    for d in reversed(src.multi_dims):  # later dims first: earlier positions stay put
        start, width = physical_start(src, d), src.physical_dims(d)
        specs[start:start + width] = [specs[start], U]
        ops.append(Merge(start + 1, width - 1, tuple(specs)))
        ops.append(GatherPieces(start, src.piece_indices(d)[1], tuple(specs)))
        specs[start:start + 2] = [specs[start]]
        ops.append(Merge(start, 2, tuple(specs)))
    ops.append(Relayout(tuple(new.tf_layout.sharding_specs)))
    return new, prog.steps, ops


def ride_target(src: DTensorSpec, dst: DTensorSpec) -> DTensorSpec:
    """What the program moves ``src`` to before ``dst``'s nested dims are built.

    ``dst`` with each nested dim sharded on its outermost mesh dim only; an
    inner mesh dim that ``src`` already uses (a Shard of another free dim, or
    a Partial) keeps it, and later moves straight into its nested place with
    one all-to-all (or reduce-scatter), as torch does, instead of a gather.
    """
    outer = list(dst.outer_only().root_placements)
    for d in dst.multi_dims:
        for m in dst.shard_groups[d][1:]:
            p = src.root_placements[m]
            taken = {q.dim for i, q in enumerate(outer) if isinstance(q, Shard) and i != m}
            if p.is_partial() or (isinstance(p, Shard) and p.dim != d and p.dim not in taken):
                outer[m] = p
    return DTensorSpec(src.mesh.root_mesh, tuple(outer), src.shape)


def expand(inner: DTensorSpec, dst: DTensorSpec, itemsize: int) -> tuple[list[TransformStep], list[Op]]:
    """``inner`` -> ``dst``: per device, a local gather of its outer piece's leaf chunks; then
    the inner mesh dims that rode along move into their nested place (all-to-all, or
    reduce-scatter for a Partial); the other inner mesh dims are a local shard."""
    root = inner.mesh.root_mesh
    specs = list(inner.tf_layout.sharding_specs)
    sizes = list(inner.physical_shape)
    ops: list[Op] = []
    for d in reversed(dst.multi_dims):  # later dims first: earlier positions stay put
        start = physical_start(inner, d)
        group = dst.shard_groups[d]
        k1 = dst.root_shape[group[0]]
        leaves = [dst.root_shape[m] for m in group[1:]] + [dst.leaf_size(d)]
        split = specs[:start + 1] + [U] + specs[start + 1:]
        ops.append(Split(start, (k1, -1), tuple(split)))
        ops.append(GatherPieces(start, dst.piece_indices(d)[0], tuple(split)))
        specs[start + 1:start + 1] = [U] * len(leaves)
        ops.append(Split(start + 1, tuple(leaves), tuple(specs)))
        sizes[start:start + 1] = [k1] + leaves
    steps = []
    lead = list(inner.partial_mesh_dims)
    for m, (p, q) in enumerate(zip(inner.root_placements, dst.root_placements)):
        rode = p.is_partial() or isinstance(p, Shard)
        if p == q or not rode or not isinstance(q, Shard) or q.dim not in dst.multi_dims \
                or m == dst.shard_groups[q.dim][0]:
            continue  # replicated inner mesh dims are a local shard at the end
        name = root.axis_names[m]
        b = specs.index(name)
        c = len(lead) + sum(dst.physical_dims(i) for i in range(q.dim)) + dst.shard_groups[q.dim].index(m)
        shards = math.prod(root.shape[root.axis_names.index(t)] for t in specs if t != U)
        k = root.shape[m]
        sent = (k - 1) / k * math.prod(sizes) / shards * itemsize
        ops.append(Move(b, c, tuple(specs), reduce_scatter=p.is_partial()))
        specs[c], specs[b] = specs[b], U
        if p.is_partial():
            ops.append(Reduce(p.reduce_op, (b,)))
            del specs[b], sizes[b]
            ops.append(Relayout(tuple(specs)))
            lead.remove(m)
            steps.append(TransformStep(name, p, q, "reduce_scatter", sent))
        else:
            steps.append(TransformStep(name, p, q, "all_to_all", sent))
            n = dst.shape[p.dim]  # that dim is whole on every device now: drop its padding
            if sizes[b] != n:
                sizes[b] = n
                ops.append(Resize(b, n, tuple(specs)))
    ops.append(Relayout(tuple(dst.tf_layout.sharding_specs)))
    return steps, ops
