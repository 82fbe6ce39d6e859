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
sender first sends a small header with the shapes and dtypes of what follows
(torch exchanges the same metadata in its stage shape inference).
"""

from __future__ import annotations

import zlib
from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = ["Channel", "as_local", "channel_index"]

_HEADER_LEN = 64  # int64 slots: count, then (dtype, rank, dims...) per tensor
_POSITIONS = 1 << 14  # instance keys per channel and step (tensors a channel carries in one step)
_PAIRS = 1 << 8  # client pairs per boundary (stages on sub-meshes spanning up to 256 clients)


def channel_index(boundary: int, direction: int, pair: int) -> int:
    """The number of one channel: the boundary after stage ``boundary``, ``direction`` 0 forward and 1
    backward, ``pair`` the client pair of stages spanning clients; the same on both clients."""
    if not 0 <= pair < _PAIRS or (2 * boundary + 1 + 1) * _PAIRS * _POSITIONS >= 1 << 31:
        raise ValueError(f"a pipeline has at most {(1 << 31) // (_PAIRS * _POSITIONS) // 2} boundaries and "
                         f"{_PAIRS} client pairs per boundary; received boundary {boundary}, pair {pair}.")
    return (2 * boundary + direction) * _PAIRS + pair


def group_key(index: int, source_device: str, target_device: str) -> int:
    """The collective group of one channel, the same on both clients (kept in [2**30, 2**31)).

    Every channel has a group of its own: two channels between the same devices (in a V-shaped plan,
    a gradient going back and an activation going forward) sharing a group hang TF's collective
    executor when their transfers interleave differently on the two sides.
    """
    return (1 << 30) | (zlib.crc32(f"{index}|{source_device}|{target_device}".encode()) & ((1 << 30) - 1))


def as_local(t: Any) -> tf.Tensor:
    """A stage output as one plain tensor: a DTensor of a sub-mesh stage is replicated first."""
    if isinstance(t, tf.Tensor) and dtensor.is_dtensor(t):
        layout = dtensor.fetch_layout(t)
        if not layout.is_fully_replicated():
            t = dtensor.relayout(t, dtensor.Layout.replicated(layout.mesh, t.shape.rank))
        return dtensor.unpack(t)[0]  # every component holds the whole tensor now
    return tf.convert_to_tensor(t)


def _header(tensors: tuple) -> tf.Tensor:
    values = [len(tensors)]
    for t in tensors:
        values += [t.dtype.as_datatype_enum, t.shape.rank, *t.shape.as_list()]
    if len(values) > _HEADER_LEN:
        raise ValueError(f"a pipeline boundary between clients carries at most {_HEADER_LEN} header values "
                         f"(tensor count, dtypes, ranks and dims); this one needs {len(values)}.")
    return tf.constant(values + [0] * (_HEADER_LEN - len(values)), tf.int64)


def _specs(header: tf.Tensor) -> list[tuple[list[int], tf.DType]]:
    values = header.numpy().tolist()
    specs, at = [], 1
    for _ in range(values[0]):
        dtype, rank = tf.as_dtype(values[at]), values[at + 1]
        specs.append((values[at + 2: at + 2 + rank], dtype))
        at += 2 + rank
    return specs


class Channel:
    """One direction of one pipeline boundary between two clients.

    Args:
        index: the channel's number in the schedule (the same on both clients).
        source_device, target_device: full device names of the sending and receiving stages.
        sending: whether this client is the sending side.
        timeout: seconds a transfer may wait for the other side before TF fails it.
    """

    def __init__(self, index: int, source_device: str, target_device: str, sending: bool,
                 timeout: float) -> None:
        self.index, self.sending, self.timeout = index, sending, timeout
        self.device = source_device if sending else target_device
        self.group_key = group_key(index, source_device, target_device)
        self.bytes_sent = 0
        self.begin_step()

    def begin_step(self) -> None:
        """The next transfer is the first of a step: it carries the header again."""
        self._position = 0
        self._specs: list | None = None

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
                input=t, group_size=2, group_key=self.group_key, instance_key=self._instance_key(),
                communication_hint="auto", timeout_seconds=self.timeout)

    def _recv_one(self, shape: list[int], dtype: tf.DType) -> tf.Tensor:
        with tf.device(self.device):
            return tf.raw_ops.CollectiveBcastRecvV2(
                group_size=2, group_key=self.group_key, instance_key=self._instance_key(), shape=shape, T=dtype,
                communication_hint="auto", timeout_seconds=self.timeout)

    def send(self, tensors: tuple) -> None:
        """Sends one microbatch's tensors (a tuple) to the other client."""
        tensors = tuple(as_local(t) for t in tensors)
        if self._specs is None:
            self._send_one(_header(tensors))
            self._specs = [(t.shape.as_list(), t.dtype) for t in tensors]
        elif [(t.shape.as_list(), t.dtype) for t in tensors] != self._specs:
            raise ValueError(f"pipeline channel {self.index}: microbatches of one step must have one shape; "
                             f"got {[(t.shape.as_list(), t.dtype.name) for t in tensors]} after "
                             f"{[(s, d.name) for s, d in self._specs]}.")
        for t in tensors:
            self._send_one(t)
            self.bytes_sent += t.shape.num_elements() * t.dtype.size

    def recv(self) -> tuple:
        """Receives one microbatch's tensors from the other client, on this side's device."""
        if self._specs is None:
            self._specs = _specs(self._recv_one([_HEADER_LEN], tf.int64))
        return tuple(self._recv_one(shape, dtype) for shape, dtype in self._specs)
