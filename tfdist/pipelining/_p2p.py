"""Point-to-point transfers between the clients of a multi-client pipeline.

TF DTensor moves data only inside one mesh and refuses to copy a tensor from
one client's devices to another's (docs/tf_dtensor_repros/cross_client_copy.py),
so a pipeline boundary between clients uses TensorFlow's own collective
broadcast over a group of two devices, the sending stage's and the receiving
stage's: ``CollectiveBcastSendV2`` on one side, ``CollectiveBcastRecvV2`` on
the other.  That is torch's ``isend``/``irecv`` pair: the tensor's bytes cross
once, through TF's collective executor (gRPC between hosts on CPU).

A ``Channel`` is one direction of one boundary (activations forward, input
gradients backward).  Its transfers happen in an order both clients derive
from the schedule's plan (the producing stage's order), so the two sides of
every transfer meet without any negotiation.  At the start of a step the
sender first sends a small header with the shapes, dtypes and layouts of what
follows (torch exchanges the same metadata in its stage shape inference).

Between stages on congruent sub-meshes (the same dim names and shape, the two
clients holding the same mesh coordinates) a channel carries each tensor
shard-wise: the sending client's distinct shards of the DTensor as it is laid
out (a shard replicated on several of its devices once), packed on the other
side into the same layout on the receiving sub-mesh. Nothing is gathered
before the transfer nor sliced after it; each client pair moves the part of
the tensor its devices hold, as each torch rank sends its own part. Other
pairs carry the whole (replicated) tensor.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = ["Channel", "Wire", "as_local", "channel_index", "from_wire", "to_wire"]

_HEADER_LEN = 64  # int64 slots: count, then (dtype, rank, dims..., mesh dim per dim...) per tensor
_POSITIONS = 1 << 14  # instance keys per channel and step (tensors a channel carries in one step)
_PAIRS = 1 << 8  # client pairs per boundary (stages on sub-meshes spanning up to 256 clients)


def channel_index(boundary: int, direction: int, pair: int) -> int:
    """The number of one channel: the boundary after stage ``boundary``, ``direction`` 0 forward and 1
    backward, ``pair`` the client pair of stages spanning clients; the same on both clients."""
    if not 0 <= pair < _PAIRS or (2 * boundary + 1 + 1) * _PAIRS * _POSITIONS >= 1 << 31:
        raise ValueError(f"a pipeline has at most {(1 << 31) // (_PAIRS * _POSITIONS) // 2} boundaries and "
                         f"{_PAIRS} client pairs per boundary; received boundary {boundary}, pair {pair}.")
    return (2 * boundary + direction) * _PAIRS + pair


def group_key(index: int, source_device: str, target_device: str, signature: str = "") -> int:
    """The collective group of one channel, the same on both clients (kept in [2**30, 2**31)).

    Every channel has a group of its own: two channels between the same devices (in a V-shaped plan,
    a gradient going back and an activation going forward) sharing a group hang TF's collective
    executor when their transfers interleave differently on the two sides.  The tensors follow the
    header in a group of their ``signature`` (shapes, dtypes, layouts): TF's collective executor keeps
    the shape an instance key first had, so tensors of another shape (a step with another batch size,
    a later schedule between the same devices) must not reuse its instance keys.
    """
    name = f"{index}|{source_device}|{target_device}|{signature}"
    return (1 << 30) | (zlib.crc32(name.encode()) & ((1 << 30) - 1))


def as_local(t: Any) -> tf.Tensor:
    """A stage output as one plain tensor: a DTensor of a sub-mesh stage is replicated first."""
    if isinstance(t, tf.Tensor) and dtensor.is_dtensor(t):
        layout = dtensor.fetch_layout(t)
        if not layout.is_fully_replicated():
            t = dtensor.relayout(t, dtensor.Layout.replicated(layout.mesh, t.shape.rank))
        return dtensor.unpack(t)[0]  # every component holds the whole tensor now
    return tf.convert_to_tensor(t)


@dataclasses.dataclass(frozen=True)
class Wire:
    """One tensor as a channel carries it: its global ``shape`` and ``dtype``, ``spec[i]`` the mesh dim
    that shards tensor dim ``i`` (-1: not sharded), and ``shards``, the distinct parts one client's
    devices hold, in the order of their mesh coordinates along the sharding dims (one part: the whole
    tensor)."""

    shape: tuple[int, ...]
    dtype: tf.DType
    spec: tuple[int, ...]
    shards: tuple[tf.Tensor, ...]

    @property
    def meta(self) -> tuple:
        return self.shape, self.dtype, self.spec, len(self.shards)


def _local_coordinates(mesh: dtensor.Mesh) -> list[tuple[int, ...]]:
    """The mesh coordinate of each of this client's devices, in the order ``dtensor.unpack`` gives
    their components."""
    return [tuple(int(c) for c in np.unravel_index(p, mesh.shape())) for p in mesh.local_device_ids()]


def _shard_key(coordinate: tuple[int, ...], spec: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(coordinate[d] for d in spec if d >= 0)


def _shard_keys(coordinates: list[tuple[int, ...]], spec: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The distinct shards devices at ``coordinates`` hold under ``spec``, in the order they travel."""
    return sorted({_shard_key(c, spec) for c in coordinates})


def to_wire(t: Any, mesh: dtensor.Mesh | None) -> Wire:
    """``t`` as a channel sends it: its distinct local shards when it is a DTensor on ``mesh`` (the
    sending stage's sub-mesh, given when the pair's sub-meshes are congruent), else the whole tensor
    (a sharded DTensor is replicated first)."""
    if mesh is not None and isinstance(t, tf.Tensor) and dtensor.is_dtensor(t) and (
            dtensor.fetch_layout(t).mesh == mesh):
        layout = dtensor.fetch_layout(t)
        names = layout.mesh.dim_names
        spec = tuple(-1 if s == dtensor.UNSHARDED else names.index(s) for s in layout.sharding_specs)
        by_key: dict[tuple[int, ...], tf.Tensor] = {}
        # components are handles on the client's devices: picking one per shard copies nothing
        coordinates = _local_coordinates(layout.mesh)
        for coordinate, part in zip(coordinates, dtensor.unpack(t)):
            by_key.setdefault(_shard_key(coordinate, spec), part)
        return Wire(tuple(t.shape.as_list()), t.dtype, spec, tuple(by_key[k] for k in _shard_keys(coordinates, spec)))
    whole = as_local(t)
    return Wire(tuple(whole.shape.as_list()), whole.dtype, (-1,) * whole.shape.rank, (whole,))


def from_wire(wire: Wire, mesh: dtensor.Mesh | None) -> tf.Tensor:
    """The tensor a channel received: the whole tensor as it came, or its shards packed in the sender's
    layout on ``mesh``, the receiving stage's (congruent) sub-mesh."""
    if all(d < 0 for d in wire.spec):
        return wire.shards[0]
    coordinates = _local_coordinates(mesh)
    parts = dict(zip(_shard_keys(coordinates, wire.spec), wire.shards))
    specs = [dtensor.UNSHARDED if d < 0 else mesh.dim_names[d] for d in wire.spec]
    return dtensor.pack([parts[_shard_key(c, wire.spec)] for c in coordinates], dtensor.Layout(specs, mesh))


def _header(wires: tuple[Wire, ...]) -> tf.Tensor:
    values = [len(wires)]
    for w in wires:
        values += [w.dtype.as_datatype_enum, len(w.shape), *w.shape, *w.spec]
    if len(values) > _HEADER_LEN:
        raise ValueError(f"a pipeline boundary between clients carries at most {_HEADER_LEN} header values "
                         f"(tensor count, dtypes, ranks, dims and layouts); this one needs {len(values)}.")
    return tf.constant(values + [0] * (_HEADER_LEN - len(values)), tf.int64)


def _metas(header: tf.Tensor, mesh_shape: list[int] | None, coordinates: list | None) -> list[tuple]:
    """What follows a header: per tensor (shape, dtype, spec, shard shape, number of shards)."""
    values = header.numpy().tolist()
    metas, at = [], 1
    for _ in range(values[0]):
        dtype, rank = tf.as_dtype(values[at]), values[at + 1]
        shape = tuple(values[at + 2: at + 2 + rank])
        spec = tuple(values[at + 2 + rank: at + 2 + 2 * rank])
        at += 2 + 2 * rank
        part = [n if d < 0 else n // mesh_shape[d] for n, d in zip(shape, spec)]
        count = 1 if all(d < 0 for d in spec) else len(_shard_keys(coordinates, spec))
        metas.append((shape, dtype, spec, part, count))
    return metas


class Channel:
    """One direction of one pipeline boundary between two clients.

    Args:
        index: the channel's number in the schedule (the same on both clients).
        source_device, target_device: full device names of the sending and receiving stages.
        sending: whether this client is the sending side.
        timeout: seconds a transfer may wait for the other side before TF fails it.
        mesh: the receiving stage's TF mesh (None for a stage on one device).
    """

    def __init__(self, index: int, source_device: str, target_device: str, sending: bool,
                 timeout: float, mesh: dtensor.Mesh | None = None) -> None:
        self.index, self.sending, self.timeout = index, sending, timeout
        self.mesh = mesh
        self.device = source_device if sending else target_device
        self._ends = (source_device, target_device)
        self.group_key = group_key(index, source_device, target_device)  # the header's
        self.bytes_sent = 0
        self.begin_step()

    def begin_step(self) -> None:
        """The next transfer is the first of a step: it carries the header again."""
        self._position = 0
        self._metas: list | None = None
        self._data_group = self.group_key

    def _follow_header(self, metas: list) -> None:
        """Sets what follows the header: its ``metas`` and the group of their signature."""
        self._metas = metas
        signature = repr([(list(m[0]), m[1].name, list(m[2])) for m in metas])
        self._data_group = group_key(self.index, *self._ends, signature)

    def _instance_key(self) -> int:
        # the same sequence on both sides; reused from step to step, as a compiled collective is
        if self._position >= _POSITIONS - 1:
            raise ValueError(f"pipeline channel {self.index}: at most {_POSITIONS - 1} tensors per step.")
        key = 1 + self.index * _POSITIONS + self._position
        self._position += 1
        return key

    def _send_one(self, t: tf.Tensor) -> None:
        with tf.device(self.device):
            tf.raw_ops.CollectiveBcastSendV2(
                input=t, group_size=2, group_key=self._data_group, instance_key=self._instance_key(),
                communication_hint="auto", timeout_seconds=self.timeout)

    def _recv_one(self, shape: list[int], dtype: tf.DType) -> tf.Tensor:
        with tf.device(self.device):
            return tf.raw_ops.CollectiveBcastRecvV2(
                group_size=2, group_key=self._data_group, instance_key=self._instance_key(), shape=shape, T=dtype,
                communication_hint="auto", timeout_seconds=self.timeout)

    def send(self, wires: tuple[Wire, ...]) -> None:
        """Sends one microbatch's tensors (``to_wire`` forms) to the other client."""
        metas = [w.meta for w in wires]
        if self._metas is None:
            self._send_one(_header(wires))
            self._follow_header(metas)
        elif metas != self._metas:
            raise ValueError(f"pipeline channel {self.index}: microbatches of one step must have one shape and "
                             f"layout; got {[(list(m[0]), m[1].name, m[2]) for m in metas]} after "
                             f"{[(list(m[0]), m[1].name, m[2]) for m in self._metas]}.")
        for w in wires:
            for part in w.shards:
                self._send_one(part)
                self.bytes_sent += part.shape.num_elements() * part.dtype.size

    def recv(self) -> tuple[Wire, ...]:
        """Receives one microbatch's tensors from the other client, on this side's device (``from_wire``
        makes them the receiving stage's tensors)."""
        if self._metas is None:
            shape = None if self.mesh is None else self.mesh.shape()
            coordinates = None if self.mesh is None else _local_coordinates(self.mesh)
            self._follow_header(_metas(self._recv_one([_HEADER_LEN], tf.int64), shape, coordinates))
        return tuple(Wire(shape, dtype, spec, tuple(self._recv_one(part, dtype) for _ in range(count)))
                     for shape, dtype, spec, part, count in self._metas)
