"""Index checks TF's CPU kernels make, made in a traced step on a mesh and raised on the host after it.

On one device, a gather of an id outside its table, or a sparse cross-entropy label outside its
classes, stops the step with ``InvalidArgumentError``.  On a mesh the same id either reaches a
kernel that raises inside the expanded program -- and then every later collective of the process
fails ("Unable to copy tensor value for broadcast"): one bad batch ends the session -- or meets
tfdist's sharded forms (a vocabulary-sharded lookup, the class-sharded cross-entropy), which have
no kernel to raise and give zeros or NaN.

The one rule: inside a step traced by tfdist's Keras trainer (``collecting()``), every index a
checked op reads -- ``GatherV2`` and ``ResourceGather`` (found by ``tensor/_legalize.py``'s op
callback, whoever wrote the gather: Keras' ``Embedding``, keras-hub, FSDP's lookup) and the ids
and labels tfdist's sharded lookup and cross-entropy take -- is reduced to its smallest and
largest value and clipped into range, so the program runs to its end with every collective
matched.  The step returns the extremes beside its outputs (one small vector per step), and
the host raises the first failed check with TF's own message before Keras sees the step's
outputs.  The step that held the bad id has run (with the id clipped); one device's would have
stopped before its update, which is the one difference.

Example::

    with collecting() as checks:
        rows = tf.gather(table, checked_indices(ids, table.shape[0], "indices"))
    ...
    checks.raise_failed(values)     # on the host, with the traced step's returned values
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf

__all__ = ["Checks", "collecting", "checked_indices", "checked_step", "gather_size", "active", "suspended",
           "lookup_ids"]


@dataclasses.dataclass(frozen=True)
class _Check:
    size: int
    message: str  # TF's kernel message, "{value}" standing for the offending value


class Checks:
    """The checks one traced step records: what each means, and the tensors of their extremes."""

    def __init__(self) -> None:
        self.graph = tf.compat.v1.get_default_graph()  # the step's: a nested function's ops are not checked
        self.suspended = False
        self.checks: list[_Check] = []
        self._extremes: list[tf.Tensor] = []  # [2, batch] each
        self._order: list[int] = []  # the checks in the order values() returns them
        self._seen: dict[tuple[int, int], tf.Tensor] = {}

    def add(self, indices: tf.Tensor, size: int, message: str) -> tf.Tensor:
        key = (id(indices), size)
        if key in self._seen:
            return self._seen[key]
        ids = tf.cast(indices, tf.int64)
        ids = tf.reshape(ids, [1, 1]) if ids.shape.rank == 0 else tf.reshape(ids, [tf.shape(ids)[0], -1])
        # per example (the leading, batch-sharded dim): max of -ids and of ids, [2, batch] -- local
        # to each device; every check of the step is reduced over the batch in one op (values())
        self._extremes.append(tf.transpose(tf.reduce_max(tf.stack([-ids, ids], axis=-1), axis=1)))
        self.checks.append(_Check(size, message))
        clipped = tf.clip_by_value(indices, tf.cast(0, indices.dtype), tf.cast(size - 1, indices.dtype))
        self._seen[key] = clipped
        return clipped

    def values(self) -> tf.Tensor | None:
        """The extremes of every check, ``[-min0, max0, -min1, max1, ...]`` (None: no check): one
        reduction (one all-reduce where the batch is sharded) for the checks of each batch size."""
        if not self._extremes:
            return None
        groups: dict = {}
        for i, extremes in enumerate(self._extremes):
            # an unknown batch size is its own group: two unknown sizes may differ when run
            groups.setdefault(extremes.shape[1] if extremes.shape[1] is not None else -1 - i, []).append(i)
        self._order = [i for members in groups.values() for i in members]
        reduced = [tf.reshape(tf.reduce_max(tf.concat([self._extremes[i] for i in members], axis=0), axis=1), [-1])
                   for members in groups.values()]
        return tf.concat(reduced, axis=0)

    def raise_failed(self, values: Any) -> None:
        """Raises TF's ``InvalidArgumentError`` for the first check whose extremes leave its range."""
        extremes = np.asarray(values).reshape(-1, 2)
        order = self._order or range(len(self.checks))
        for check, (neg_low, high) in zip((self.checks[i] for i in order), extremes):
            low = -int(neg_low)
            if low < 0 or high >= check.size:
                value = low if low < 0 else int(high)
                raise tf.errors.InvalidArgumentError(None, None, check.message.format(value=value))


_ACTIVE: contextvars.ContextVar[Checks | None] = contextvars.ContextVar("tfdist_step_checks", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[Checks]:
    """Checks recorded by the ops traced in the block (a step program)."""
    checks = Checks()
    token = _ACTIVE.set(checks)
    try:
        yield checks
    finally:
        _ACTIVE.reset(token)


def checked_indices(indices: tf.Tensor, size: int, message: str) -> tf.Tensor:
    """``indices``, checked to lie in ``[0, size)``.

    Eagerly: raises now.  Traced inside ``collecting()``: recorded, and clipped into range (the
    step runs to its end; the host raises after it).  Traced elsewhere: unchanged (the caller's
    kernel or fallback decides).  ``message``: TF's, with ``{value}`` for the offending id."""
    if tf.executing_eagerly():
        if indices.shape.num_elements() == 0:
            return indices
        low, high = int(tf.reduce_min(indices)), int(tf.reduce_max(indices))
        if low < 0 or high >= size:
            raise tf.errors.InvalidArgumentError(None, None, message.format(value=low if low < 0 else high))
        return indices
    checks = _ACTIVE.get()
    if checks is None or checks.suspended or not indices.dtype.is_integer or indices.graph is not checks.graph:
        return indices
    return checks.add(indices, size, message)


def lookup_ids(ids: tf.Tensor, size: int, message: str) -> tf.Tensor:
    """The int32 rows a Keras ``Embedding`` of ``size`` rows reads for ``ids``: a negative id
    counts from the end, once (Keras' ``ops.take``), then checked (``checked_indices``)."""
    ids = tf.cast(ids, tf.int32)
    return checked_indices(tf.where(ids < 0, ids + size, ids), size, message)


def active() -> bool:
    """Whether ops traced now are checked (inside ``collecting()``, not ``suspended()``)."""
    checks = _ACTIVE.get()
    return checks is not None and not checks.suspended


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Gathers traced in the block go unchecked: their indices are in range by construction (a
    sharded lookup's rows of its shard, computed from ids it checked itself)."""
    checks = _ACTIVE.get()
    saved = checks.suspended if checks is not None else None
    if checks is not None:
        checks.suspended = True
    try:
        yield
    finally:
        if checks is not None:
            checks.suspended = saved


def gather_size(op: Any) -> int | None:
    """The size of the dim a traced ``GatherV2``/``ResourceGather`` indexes (None: not static)."""
    if op.type == "GatherV2":
        axis = tf.get_static_value(op.inputs[2])
        rank = op.inputs[0].shape.rank
        if axis is None or rank is None:
            return None
        return op.inputs[0].shape[int(axis) % rank]
    if op.type == "ResourceGather":
        from tensorflow.python.ops import handle_data_util

        data = handle_data_util.get_resource_handle_data(op.inputs[0])
        if not data.is_set or not data.shape_and_type or data.shape_and_type[0].shape.unknown_rank:
            return None
        dims = data.shape_and_type[0].shape.dim
        batch_dims = op.get_attr("batch_dims")
        size = dims[batch_dims].size if len(dims) > batch_dims else -1
        return size if size >= 0 else None
    return None


def checked_step(step: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``step(data)`` traced inside ``collecting()``, returning ``(outputs, extremes or None)``;
    ``checked_step(step).checks`` holds the last trace's checks (``Checks.raise_failed``)."""

    def run(data):
        with collecting() as checks:
            outputs = step(data)
        run.checks = checks
        return outputs, checks.values()

    run.checks = Checks()
    run.__wrapped__ = step
    return run
