"""context_parallel: sequence-sharded attention for Keras MultiHeadAttention.

Inside the context, buffers are sharded on their sequence dims over the
context-parallel mesh, and every ``keras.layers.MultiHeadAttention`` keeps
its *queries* sharded on the sequence while its keys and values are
gathered on it (torch's "allgather" rotate method).  Each device then
attends its block of queries to all keys: the output equals unsharded
attention exactly (the causal mask is built from global positions).

TensorFlow tensors are immutable, so the sharded buffers are *yielded*
instead of being replaced in place as torch does; ``no_restore_buffers`` is
accepted for the same reason and has nothing to do.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._api import DTensor, distribute_tensor
from tfdist.tensor._layout import physical_layout, to_root_placements
from tfdist.tensor._modules import loaded_backends
from tfdist.tensor.parallel.style import as_tf, on_mesh
from tfdist.tensor.placement_types import Replicate, Shard

__all__ = ["context_parallel"]


def _layout(mesh: DeviceMesh, rank: int, seq_dim: int | None) -> dtensor.Layout:
    root = mesh.root_mesh
    base = [Replicate()] * root.ndim
    others = [d for d in range(root.ndim) if d not in mesh.root_dims]
    if len(others) == 1 and seq_dim != 0:
        base[others[0]] = Shard(0)  # the batch stays data-parallel
    placements = to_root_placements(mesh, [Shard(seq_dim) if seq_dim is not None else Replicate()], base)
    return physical_layout(root, placements, rank)


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[Any] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set | None = None,
) -> Iterator[list[DTensor]]:
    """Shards ``buffers`` on their sequence dims and runs Keras attention context-parallel.

    Args:
        mesh: a 1-D mesh or 1-D slice (``mesh["cp"]``) for the sequence.
        buffers: tensors (global values) or DTensors to shard.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: accepted for torch compatibility (nothing is
            modified in place, so nothing is restored).

    Yields:
        The buffers as DTensors sharded on their sequence dims.

    Example::

        with context_parallel(mesh["cp"], buffers=[x], buffer_seq_dims=[1]) as (xs,):
            y = tf.function(lambda t: attn(t, t, use_causal_mask=True))(xs)
    """
    del no_restore_buffers
    if mesh.ndim != 1:
        raise ValueError(
            f"context_parallel needs a 1-D mesh or slice for the sequence. Received: a "
            f"{mesh.ndim}-D mesh {mesh.axis_names}."
        )
    buffers = list(buffers or [])
    seq_dims = list(buffer_seq_dims or [])
    if len(seq_dims) != len(buffers):
        raise ValueError(
            f"buffer_seq_dims needs one entry per buffer: {len(buffers)} buffers, "
            f"{len(seq_dims)} dims. Received: buffer_seq_dims={buffer_seq_dims!r}"
        )
    sharded = []
    for buf, dim in zip(buffers, seq_dims):
        placements = [Shard(dim)]
        if isinstance(buf, DTensor):
            sharded.append(buf.redistribute(mesh, placements))
        else:
            sharded.append(distribute_tensor(buf, mesh, placements))

    tf_mesh = mesh.root_mesh.to_tf()

    def relayout_qkv(query, key, value):
        query, key, value = (on_mesh(as_tf(t), tf_mesh) for t in (query, key, value))
        query = dtensor.relayout(query, _layout(mesh, query.shape.rank, 1))
        key = dtensor.relayout(key, _layout(mesh, key.shape.rank, None))
        value = dtensor.relayout(value, _layout(mesh, value.shape.rank, None))
        return query, key, value

    with contextlib.ExitStack() as stack:
        for modules in loaded_backends():
            stack.enter_context(modules.attention_scope(relayout_qkv))
        yield sharded
