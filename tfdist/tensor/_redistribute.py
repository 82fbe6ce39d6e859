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

A move is a short program of such steps, one mesh dim per collective (as
torch plans it, and because TF DTensor mis-lowers some relayouts that move
several mesh dims at once; see the step functions).  Where the order of
steps matters for the bytes (reducing Partials before or after moving the
shards that block a reduce-scatter), both programs are first run *dry* on
shapes alone and the one that moves fewer bytes per device runs.  Uneven
shards are re-padded on dims that are replicated at that moment, where
padding and slicing are local.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
from typing import Iterator, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.tensor import _comm_events
from tfdist.tensor._layout import DTensorSpec, chunk_size
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["TransformStep", "plan_redistribute", "redistribute_physical", "relayout", "check_transition",
           "reduce_scatter_move"]

logger = logging.getLogger("tfdist.redistribute")
if "redistribute" in os.environ.get("TFDIST_LOGS", "").replace(" ", "").split(","):
    logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        logging.basicConfig()

_REDUCERS = {
    "sum": tf.math.reduce_sum,
    "avg": tf.math.reduce_mean,
    "product": tf.math.reduce_prod,
    "max": tf.math.reduce_max,
    "min": tf.math.reduce_min,
}


# TF lowers CollectiveGatherV2 only for int32/int64/f16/f32/f64
# (tensorflow/dtensor/mlir/collectives.cc); other types fall back to an
# all-reduce of a padded buffer.  Same-size types that TF does gather carry
# their bits instead; 1-byte types travel in pairs (``_gather_byte_pairs``).
_GATHER_CARRIER = {
    tf.bfloat16: tf.float16, tf.int16: tf.float16, tf.uint16: tf.float16,
    tf.uint32: tf.int32, tf.uint64: tf.int64, tf.complex64: tf.int64,
}
_BYTE_TYPES = (tf.int8, tf.uint8, tf.bool)


def _gathers_natively(mesh) -> bool:
    """Whether TF lowers a gather on ``mesh`` to CollectiveGatherV2 (TPU programs never do)."""
    return "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2" in os.environ and mesh.device_type.upper() != "TPU"


def _every_other(x: tf.Tensor, axis: int, start: int) -> tf.Tensor:
    begin, end, strides = [0] * x.shape.rank, list(x.shape), [1] * x.shape.rank
    begin[axis], strides[axis] = start, 2
    return tf.strided_slice(x, begin, end, strides)


def _gather_byte_pairs(x: tf.Tensor, specs: list[str], new_specs: list[str], mesh: dtensor.Mesh) -> tf.Tensor | None:
    """All-gathers a 1-byte tensor as 16-bit values, two bytes each, with the bytes of the data.

    TF has no CollectiveGatherV2 for 1-byte types (its fallback all-reduces a
    zero-padded, widened buffer), and a size-changing ``tf.bitcast`` crashes
    under TF DTensor.  So neighbours along a dim that stays whole are packed
    arithmetically into a uint16 (``lo + 256 hi``), carried as float16 bits,
    and unpacked after the gather -- all local, elementwise work.  An odd
    whole dim is padded by one (that column travels too).  With no whole dim,
    a dim whose local chunk is even is split into (n/2, 2) first (a local
    reshape).  Returns None when neither exists (the caller falls back).
    """
    shape = x.shape.as_list()
    if None in shape:
        return None
    split = None
    e = next((i for i in reversed(range(len(specs)))
              if specs[i] == new_specs[i] == dtensor.UNSHARDED and shape[i]), None)
    if e is None:
        k = {i: mesh.dim_size(t) for i, t in enumerate(specs) if t != dtensor.UNSHARDED}
        split = next((i for i in reversed(range(len(specs))) if shape[i] and (shape[i] // k.get(i, 1)) % 2 == 0), None)
        if split is None:
            return None
        x = tf.reshape(x, shape[:split] + [shape[split] // 2, 2] + shape[split + 1:])
        specs = specs[:split + 1] + [dtensor.UNSHARDED] + specs[split + 1:]
        new_specs = new_specs[:split + 1] + [dtensor.UNSHARDED] + new_specs[split + 1:]
        x, e = dtensor.relayout(x, dtensor.Layout(specs, mesh)), split + 1
    if tf.executing_eagerly():  # eagerly, TF DTensor's Pack would gather its inputs first: run it traced
        v = _byte_pairs_program(e, tuple(specs), tuple(new_specs), mesh)(x)
    else:
        v = _byte_pairs_gathered(x, e, specs, new_specs, mesh)
    if split is not None:
        v = tf.reshape(v, shape)
        new_specs = new_specs[:split + 1] + new_specs[split + 2:]
    return dtensor.relayout(v, dtensor.Layout(new_specs, mesh))


@functools.lru_cache(maxsize=256)
def _byte_pairs_program(e: int, specs: tuple, new_specs: tuple, mesh: dtensor.Mesh):
    return tf.function(lambda x: _byte_pairs_gathered(x, e, list(specs), list(new_specs), mesh), autograph=False)


def _byte_pairs_gathered(x: tf.Tensor, e: int, specs: list[str], new_specs: list[str], mesh: dtensor.Mesh) -> tf.Tensor:
    """``_gather_byte_pairs`` along whole dim ``e``: pack, gather, unpack (same dtype and shape)."""
    dtype, n = x.dtype, x.shape[e]
    layout = dtensor.Layout(specs, mesh)
    v = tf.math.floormod(tf.cast(x, tf.int32), 256)  # int8 -128..127 -> its byte 0..255
    if n % 2:
        pads = [[0, 0]] * len(specs)
        pads[e] = [0, 1]
        v = dtensor.relayout(tf.pad(v, pads), layout)
    packed = _every_other(v, e, 0) + 256 * _every_other(v, e, 1)
    packed = tf.bitcast(tf.cast(dtensor.relayout(packed, layout), tf.uint16), tf.float16)
    packed = dtensor.relayout(packed, dtensor.Layout(new_specs, mesh))  # the all-gather
    packed = tf.cast(tf.bitcast(packed, tf.uint16), tf.int32)
    pairs = tf.stack([tf.math.floormod(packed, 256), tf.math.floordiv(packed, 256)], axis=e + 1)
    pairs = dtensor.relayout(pairs, dtensor.Layout(new_specs[:e + 1] + [dtensor.UNSHARDED] + new_specs[e + 1:], mesh))
    shape = pairs.shape.as_list()
    v = tf.reshape(pairs, shape[:e] + [shape[e] * 2] + shape[e + 2:])
    if n % 2:
        size = list(v.shape)
        size[e] = n
        v = tf.slice(v, [0] * len(size), size)
    if dtype == tf.bool:
        return tf.not_equal(v, 0)
    if dtype == tf.int8:
        return tf.cast(v - 256 * tf.cast(v >= 128, tf.int32), tf.int8)
    return tf.cast(v, dtype)


@dataclasses.dataclass(frozen=True)
class TransformStep:
    """One step of a redistribute: a mesh dim's collective and the bytes each device sends."""

    mesh_dim: str
    src: Placement
    dst: Placement
    collective: str  # all_gather, all_to_all, all_reduce, reduce_scatter, none
    bytes_per_device: float = 0.0

    def __str__(self) -> str:
        return f"{self.mesh_dim}: {self.src} -> {self.dst} ({self.collective})"


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


def _move_mesh_dim(x: tf.Tensor | None, specs: list[str], b: int, c: int, mesh) -> tuple[tf.Tensor | None, list[str]]:
    """One all-to-all: the mesh dim sharding physical dim ``b`` moves onto ``c``.

    TF DTensor 2.21 computes wrong values for an all-to-all relayout of a
    rank >= 4 tensor when another mesh dim shards a third dim and neither
    moved dim is dim 0 (docs/tf_dtensor_repros/all_to_all_wrong_values.py);
    moves to or from dim 0 are right.  So such a tensor is transposed (a local
    op) to put ``b`` and ``c`` first, moved, and transposed back.
    """
    new = list(specs)
    new[c], new[b] = specs[b], dtensor.UNSHARDED
    if x is None:
        return None, new
    if 0 not in (b, c) and len(specs) >= 4:
        perm = [b, c] + [d for d in range(len(specs)) if d not in (b, c)]
        inverse = [perm.index(d) for d in range(len(perm))]
        xt = dtensor.relayout(tf.transpose(x, perm), dtensor.Layout([specs[d] for d in perm], mesh))
        yt = dtensor.relayout(xt, dtensor.Layout([new[d] for d in perm], mesh))
        x = tf.transpose(yt, inverse)
    return dtensor.relayout(x, dtensor.Layout(new, mesh)), new


@contextlib.contextmanager
def _as_reduce_scatter(x: tf.Tensor | None, output_bytes: float | None, k: int) -> Iterator[None]:
    """Marks the all-to-all run inside as torch's ``reduce_scatter_tensor`` for CommDebugMode.

    Eagerly the execution is reported; in a graph its relayout gets a
    registered name scope (``_comm_events``).  ``output_bytes`` is the
    all-to-all's output per device (None if the shape is dynamic), ``k``
    its group size.
    """
    marker = ("reduce_scatter_tensor", "CollectiveAllToAllV2", output_bytes, k)
    if x is None:  # a dry run on shapes
        yield
    elif tf.executing_eagerly():
        yield
        if _comm_events.listening():
            _comm_events.report(*marker)
    else:
        with tf.name_scope(_comm_events.graph_scope(*marker)):
            yield


def reduce_scatter_move(x: tf.Tensor, specs: list[str], b: int, c: int, mesh: dtensor.Mesh) -> tuple[tf.Tensor, list[str]]:
    """The all-to-all of a reduce-scatter: a stacked Partial axis ``b`` (sharded on its mesh
    dim) moves onto dim ``c``; the caller reduces axis ``b`` locally afterwards.

    ``_move_mesh_dim``, marked for CommDebugMode as ``reduce_scatter_tensor``.
    """
    k = mesh.dim_size(specs[b])
    shards = math.prod(mesh.dim_size(s) for s in specs if s != dtensor.UNSHARDED)
    size = None if None in x.shape.as_list() else math.prod(x.shape.as_list()) / shards * x.dtype.size
    with _as_reduce_scatter(x, size, k):
        return _move_mesh_dim(x, specs, b, c, mesh)


class _Program:
    """The physical tensor and its layout while a redistribute runs, step by step.

    With ``x=None`` nothing runs: the steps only track shapes, layouts and
    the bytes each device would send (ring algorithms: all-gather (k-1) x
    the local block, all-to-all and reduce-scatter (k-1)/k x it, all-reduce
    2 (k-1)/k x it), so that two orders of steps can be compared.
    """

    def __init__(self, x: tf.Tensor | None, spec: DTensorSpec, itemsize: int) -> None:
        self.root = spec.mesh.root_mesh
        self.x = x
        self.shape = spec.shape
        self.placements = list(spec.root_placements)
        self.partial = list(spec.partial_mesh_dims)  # mesh dim of each stacked leading axis
        self.specs = list(spec.tf_layout.sharding_specs)
        self.sizes = list(spec.physical_shape)
        self.itemsize = itemsize
        self.steps: list[TransformStep] = []

    # -- bookkeeping ----------------------------------------------------------
    @property
    def lead(self) -> int:
        return len(self.partial)

    @property
    def bytes(self) -> float:
        return sum(s.bytes_per_device for s in self.steps)

    def _k(self, spec: str) -> int:
        return self.root.shape[self.root.axis_names.index(spec)]

    def _local_bytes(self) -> float:
        shards = math.prod(self._k(s) for s in self.specs if s != dtensor.UNSHARDED)
        return math.prod(self.sizes) / shards * self.itemsize

    def _relayout(self, specs: list[str]) -> None:
        self.specs = list(specs)
        if self.x is not None:
            self.x = dtensor.relayout(self.x, dtensor.Layout(self.specs, self.root.to_tf()))

    def _record(self, m: int, new: Placement, collective: str, sent: float) -> None:
        name = self.root.axis_names[m]
        self.steps.append(TransformStep(name, self.placements[m], new, collective, sent))
        self.placements[m] = new

    # -- local steps ----------------------------------------------------------
    def resize(self, d: int, n: int) -> None:
        """Pads or slices (at the end) logical dim ``d``, which must be replicated now.

        The result is pinned to the current layout: inside tf.function TF
        DTensor would otherwise pull the *next* relayout's sharding back into
        the pad, which its SPMD expander rejects.
        """
        axis = self.lead + d
        have = self.sizes[axis]
        if have == n:
            return
        self.sizes[axis] = n
        if self.x is None:
            return
        if n < have:
            size = list(self.x.shape)
            size[axis] = n
            self.x = tf.slice(self.x, [0] * len(size), size)
        else:
            pads = [[0, 0] for _ in self.sizes]
            pads[axis][1] = n - have
            self.x = tf.pad(self.x, pads)
        self._relayout(self.specs)

    # -- collectives, one mesh dim each -----------------------------------------
    def all_to_all(self, m: int, b: int, c: int, new: Placement, collective: str = "all_to_all") -> None:
        """Moves mesh dim ``m`` from physical dim ``b`` onto ``c`` (see ``_move_mesh_dim``)."""
        k = self.root.shape[m]
        sent = (k - 1) / k * self._local_bytes()
        self.x, self.specs = _move_mesh_dim(self.x, self.specs, b, c, self.root.to_tf())
        self._record(m, new, collective, sent)

    def all_gather(self, m: int, b: int) -> None:
        """Unshards physical dim ``b`` (mesh dim ``m``).

        One mesh dim per relayout: with the CollectiveGatherV2 lowering, TF
        DTensor 2.21 fails to compile a relayout that gathers two mesh dims
        at once (docs/tf_dtensor_repros/all_gather_two_mesh_dims.py); torch
        gathers mesh dim by mesh dim too, and the bytes are the same.
        """
        sent = (self.root.shape[m] - 1) * self._local_bytes()
        new_specs = list(self.specs)
        new_specs[b] = dtensor.UNSHARDED
        carrier = _GATHER_CARRIER.get(self.x.dtype) if self.x is not None else None
        paired = None
        if carrier is not None:  # a gather copies bits: move them as a type TF gathers natively
            original = self.x.dtype
            self.x = tf.bitcast(self.x, carrier)
            self._relayout(new_specs)
            self.x = tf.bitcast(self.x, original)
        elif self.x is not None and self.x.dtype in _BYTE_TYPES and _gathers_natively(self.root):
            paired = _gather_byte_pairs(self.x, self.specs, new_specs, self.root.to_tf())
        if paired is not None:
            self.x, self.specs = paired, new_specs
        elif carrier is None:
            self._relayout(new_specs)
        self._record(m, Replicate(), "all_gather", sent)

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
        with _as_reduce_scatter(self.x, self._local_bytes(), self.root.shape[m]):
            self.all_to_all(m, axis, self.lead + d, Shard(d), "reduce_scatter")
        if self.x is not None:
            self.x = _REDUCERS[op](self.x, axis=axis)
        del self.partial[axis], self.sizes[axis], self.specs[axis]
        self._relayout(self.specs)

    def all_reduce(self, mesh_dims: Sequence[int]) -> None:
        """Resolves the Partials on ``mesh_dims``: one all-reduce per reduce op."""
        by_op: dict[str, list[int]] = {}
        for m in mesh_dims:
            by_op.setdefault(self.placements[m].reduce_op, []).append(m)
        for op, dims in by_op.items():
            axes = [self.partial.index(m) for m in dims]
            for axis in sorted(axes, reverse=True):
                del self.partial[axis], self.sizes[axis], self.specs[axis]
            if self.x is not None:
                self.x = _REDUCERS[op](self.x, axis=axes)
            group = math.prod(self.root.shape[m] for m in dims)
            sent = 2 * (group - 1) / group * self._local_bytes()
            for i, m in enumerate(dims):
                self._record(m, Replicate(), "all_reduce", sent if i == 0 else 0.0)
        self._relayout(self.specs)

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
                self._relayout(specs)
                self.placements[m] = q

    def finish(self, dst: DTensorSpec) -> tf.Tensor | None:
        """Local pads and slices of the dims not sharded now, then the last (local) shards."""
        sharded = {r.dim for r in self.placements if isinstance(r, Shard)}
        for d in range(len(self.shape)):
            if d not in sharded:
                to_shard = any(r.is_shard(d) for r in dst.root_placements)
                self.resize(d, dst.padded_size(d) if to_shard else dst.shape[d])
        self.placements = list(dst.root_placements)
        if self.x is not None:
            self.x = dtensor.relayout(self.x, dst.tf_layout)
        return self.x


def _blockers(src: DTensorSpec, dst: DTensorSpec) -> set[int]:
    """Mesh dims whose Shard sits on a dim that a Partial mesh dim is to be reduce-scattered onto."""
    want = dst.root_placements
    targets = {want[m].dim for m in src.partial_mesh_dims if isinstance(want[m], Shard)}
    return {
        m for m, p in enumerate(src.root_placements)
        if isinstance(p, Shard) and p.dim in targets and want[m] != p
    }


def _run(x: tf.Tensor | None, src: DTensorSpec, dst: DTensorSpec, itemsize: int, order: tuple[bool, bool]) -> _Program:
    slices_first, blockers_first = order
    prog = _Program(x, src, itemsize)
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
def _cheapest(src: DTensorSpec, dst: DTensorSpec, itemsize: int) -> tuple[bool, bool]:
    """The order of steps that sends the fewest bytes: (local slices first, blocking shards first).

    Dry runs of each order on shapes alone; the first of equals wins.
    """
    return min(_ORDERS, key=lambda order: _run(None, src, dst, itemsize, order).bytes)


def plan_redistribute(src: DTensorSpec, dst: DTensorSpec, itemsize: int = 4) -> list[TransformStep]:
    """The steps a redistribute runs, each with its collective and bytes per device."""
    if src.root_placements == dst.root_placements:
        return []
    _, src, first = _collapse(None, src, dst, itemsize) if src.multi_dims else (None, src, [])
    inner = _ride_target(src, dst) if dst.multi_dims else dst
    middle = _run(None, src, inner, itemsize, _cheapest(src, inner, itemsize)).steps
    last = _expand(None, inner, dst, itemsize)[1] if dst.multi_dims else []
    return first + middle + last


def relayout(x: tf.Tensor, layout: dtensor.Layout, source: dtensor.Layout | None = None) -> tf.Tensor:
    """``dtensor.relayout`` that gathers one mesh dim at a time and moves mesh dims safely.

    For tfdist's own relayouts of raw TF DTensors (Keras variables and
    activations, host reads): a single relayout that gathers two mesh dims
    at once fails to compile under the CollectiveGatherV2 lowering tfdist
    enables (see ``_Program.all_gather``), and an all-to-all between two
    dims other than dim 0 of a rank >= 4 tensor computes wrong values
    (``_move_mesh_dim``), so a mesh dim that only moves goes through
    ``_move_mesh_dim``.  ``source`` is the current layout (read from
    ``x`` in eager mode when not given).
    """
    if source is None:
        source = dtensor.fetch_layout(x)
    specs = list(source.sharding_specs)
    wanted = list(layout.sharding_specs)
    for b, name in enumerate(source.sharding_specs):
        # a mesh dim that only changes tensor dim: one all-to-all (with _move_mesh_dim's workaround)
        if name != dtensor.UNSHARDED and wanted[b] != name and name in wanted:
            c = wanted.index(name)
            if specs[c] == dtensor.UNSHARDED and specs[b] == name:
                x, specs = _move_mesh_dim(x, specs, b, c, source.mesh)
    for d, (have, want) in enumerate(zip(list(specs), wanted)):
        if have != dtensor.UNSHARDED and have != want:
            specs[d] = dtensor.UNSHARDED
            x = dtensor.relayout(x, dtensor.Layout(list(specs), source.mesh))
    return dtensor.relayout(x, layout)


def _physical_start(spec: DTensorSpec, d: int) -> int:
    return len(spec.partial_mesh_dims) + sum(spec.physical_dims(i) for i in range(d))


def _gather_pieces(x: tf.Tensor, axis: int, index: np.ndarray, specs: list[str], mesh) -> tf.Tensor:
    """Per outer piece (physical ``axis``, sharded or not), a local gather along ``axis + 1``.

    ``x`` holds ``[k1, rows]`` at ``axis``; one zero row is appended to
    ``axis + 1`` (the pad slot), the two axes go to the front (a local
    transpose), ``tf.gather(..., batch_dims=1)`` picks each piece's rows, and
    the axes go back.  No collective: each device only reads its own piece.
    """
    pads = [[0, 0] for _ in x.shape]
    pads[axis + 1][1] = 1
    x = dtensor.relayout(tf.pad(x, pads), dtensor.Layout(specs, mesh))  # pinned (see _Program.resize)
    rank = x.shape.rank
    perm = [axis, axis + 1] + [i for i in range(rank) if i not in (axis, axis + 1)]
    front = dtensor.relayout(tf.transpose(x, perm), dtensor.Layout([specs[i] for i in perm], mesh))
    picked = tf.gather(front, index, axis=1, batch_dims=1)
    back = [perm.index(i) for i in range(rank)]
    return dtensor.relayout(tf.transpose(picked, back), dtensor.Layout(specs, mesh))


def _collapse(
    x: tf.Tensor | None, src: DTensorSpec, dst: DTensorSpec, itemsize: int
) -> tuple[tf.Tensor | None, DTensorSpec, list[TransformStep]]:
    """Dims sharded over several mesh dims -> sharded on the outermost one only.

    Each inner mesh dim either all-to-alls straight onto the dim ``dst``
    shards with it (when that dim is free; torch's move) or is all-gathered;
    then a local gather puts each device's leaves back in the order of its
    outer piece.
    """
    prog = _Program(x, src, itemsize)
    placements = list(src.outer_only().root_placements)
    mesh = src.mesh.root_mesh.to_tf()
    for d in src.multi_dims:
        start = _physical_start(src, d)
        for i, m in reversed(list(enumerate(src.shard_groups[d]))[1:]):
            q = dst.root_placements[m]
            busy = {p.dim for p in placements if isinstance(p, Shard)} | set(src.multi_dims)
            if isinstance(q, Shard) and q.dim not in busy and sum(r.is_shard(q.dim) for r in dst.root_placements) == 1:
                j = _physical_start(src, q.dim)  # a single, replicated dim: padding it is local
                want = chunk_size(src.shape[q.dim], src.root_shape[m]) * src.root_shape[m]
                if prog.sizes[j] != want:
                    if prog.x is not None:
                        pads = [[0, 0] for _ in prog.sizes]
                        pads[j][1] = want - prog.sizes[j]
                        prog.x = dtensor.relayout(tf.pad(prog.x, pads), dtensor.Layout(prog.specs, mesh))
                    prog.sizes[j] = want
                prog.all_to_all(m, start + i, j, q)
                prog.steps[-1] = dataclasses.replace(prog.steps[-1], src=Shard(d))
                placements[m] = q
            else:
                prog.all_gather(m, start + i)
                prog.steps[-1] = dataclasses.replace(prog.steps[-1], src=Shard(d))
    new = DTensorSpec(src.mesh.root_mesh, tuple(placements), src.shape)
    x = prog.x
    if x is not None:
        specs = list(prog.specs)
        for d in reversed(src.multi_dims):  # later dims first: earlier positions stay put
            start, width = _physical_start(src, d), src.physical_dims(d)
            shape = x.shape.as_list()
            merged = shape[:start + 1] + [int(np.prod(shape[start + 1:start + width]))] + shape[start + width:]
            specs[start:start + width] = [specs[start], dtensor.UNSHARDED]
            x = dtensor.relayout(tf.reshape(x, merged), dtensor.Layout(specs, mesh))
            x = _gather_pieces(x, start, src.piece_indices(d)[1], specs, mesh)
            shape = x.shape.as_list()
            x = tf.reshape(x, shape[:start] + [shape[start] * shape[start + 1]] + shape[start + 2:])
            specs[start:start + 2] = [specs[start]]
            x = dtensor.relayout(x, dtensor.Layout(specs, mesh))
        x = dtensor.relayout(x, new.tf_layout)
    return x, new, prog.steps


def _ride_target(src: DTensorSpec, dst: DTensorSpec) -> DTensorSpec:
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


def _expand(x: tf.Tensor | None, inner: DTensorSpec, dst: DTensorSpec, itemsize: int) -> tuple[tf.Tensor | None, list[TransformStep]]:
    """``inner`` -> ``dst``: per device, a local gather of its outer piece's leaf chunks; then
    the inner mesh dims that rode along move into their nested place (all-to-all, or
    reduce-scatter for a Partial); the other inner mesh dims are a local shard."""
    root = inner.mesh.root_mesh
    mesh = root.to_tf()
    specs = list(inner.tf_layout.sharding_specs)
    sizes = list(inner.physical_shape)
    for d in reversed(dst.multi_dims):  # later dims first: earlier positions stay put
        start = _physical_start(inner, d)
        group = dst.shard_groups[d]
        k1 = dst.root_shape[group[0]]
        leaves = [dst.root_shape[m] for m in group[1:]] + [dst.leaf_size(d)]
        if x is not None:
            shape = x.shape.as_list()
            x = tf.reshape(x, shape[:start] + [k1, shape[start] // k1] + shape[start + 1:])
            x = dtensor.relayout(x, dtensor.Layout(specs[:start + 1] + [dtensor.UNSHARDED] + specs[start + 1:], mesh))
            x = _gather_pieces(x, start, dst.piece_indices(d)[0], specs[:start + 1] + [dtensor.UNSHARDED] + specs[start + 1:], mesh)
            shape = x.shape.as_list()
            x = tf.reshape(x, shape[:start + 1] + leaves + shape[start + 2:])
        specs[start + 1:start + 1] = [dtensor.UNSHARDED] * len(leaves)
        sizes[start:start + 1] = [k1] + leaves
        if x is not None:
            x = dtensor.relayout(x, dtensor.Layout(specs, mesh))
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
        shards = math.prod(root.shape[root.axis_names.index(t)] for t in specs if t != dtensor.UNSHARDED)
        k = root.shape[m]
        sent = (k - 1) / k * math.prod(sizes) / shards * itemsize
        if p.is_partial() and x is not None:
            x, specs = reduce_scatter_move(x, specs, b, c, mesh)
        else:
            x, specs = _move_mesh_dim(x, specs, b, c, mesh)
        if p.is_partial():
            if x is not None:
                x = dtensor.relayout(_REDUCERS[p.reduce_op](x, axis=b), dtensor.Layout(specs[:b] + specs[b + 1:], mesh))
            del specs[b], sizes[b]
            lead.remove(m)
            steps.append(TransformStep(name, p, q, "reduce_scatter", sent))
        else:
            steps.append(TransformStep(name, p, q, "all_to_all", sent))
            n = dst.shape[p.dim]  # that dim is whole on every device now: drop its padding
            if sizes[b] != n:
                sizes[b] = n
                if x is not None:
                    size = x.shape.as_list()
                    size[b] = n
                    x = dtensor.relayout(tf.slice(x, [0] * len(size), size), dtensor.Layout(specs, mesh))
    if x is not None:
        x = dtensor.relayout(x, dst.tf_layout)
    return x, steps


def _empty(dtype: tf.DType, dst: DTensorSpec) -> tf.Tensor:
    """An empty tensor's physical form for ``dst``: nothing to move (TF's collectives abort
    the process on empty buffers, so none may run)."""
    zeros = tf.zeros(dst.physical_shape, dtype)
    if tf.executing_eagerly():
        zeros = dtensor.copy_to_mesh(zeros, dtensor.Layout.replicated(dst.tf_layout.mesh, len(dst.physical_shape)))
    return dtensor.relayout(zeros, dst.tf_layout)


def redistribute_physical(x: tf.Tensor, src: DTensorSpec, dst: DTensorSpec) -> tf.Tensor:
    """Returns the physical tensor for ``dst`` holding the same global values as ``x``.

    A dim sharded over several mesh dims is first gathered on its inner mesh
    dims (one all-gather each) and, in the target, sharded on them last by a
    local gather and slice: in between it is sharded on its outermost one.
    """
    if src.root_placements == dst.root_placements:
        return x
    check_transition(src, dst)
    if 0 in src.shape:
        return _empty(x.dtype, dst)
    if not (x.dtype.is_floating or x.dtype.is_integer or x.dtype.is_complex or x.dtype == tf.bool):
        moves = [s for s in plan_redistribute(src, dst) if s.collective != "none"]
        if moves:  # TF DTensor's collectives carry numbers only (a raw MLIR error otherwise)
            raise TypeError(
                f"a DTensor of dtype {x.dtype.name} cannot be moved from {src.placements} to "
                f"{dst.placements}: that needs {moves[0].collective} on mesh dim {moves[0].mesh_dim!r}, "
                "and TF DTensor collectives carry numbers only. Keep such tensors replicated "
                "(distribute_tensor(x, mesh, [Replicate()])) or encode them as numbers first."
            )
    itemsize = x.dtype.size
    x, src, _ = _collapse(x, src, dst, itemsize) if src.multi_dims else (x, src, [])
    inner = _ride_target(src, dst) if dst.multi_dims else dst
    prog = _run(x, src, inner, itemsize, _cheapest(src, inner, itemsize))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("redistribute %s: %s", src.shape, "; ".join(map(str, prog.steps)) or "local")
    return _expand(prog.x, inner, dst, itemsize)[0] if dst.multi_dims else prog.x
