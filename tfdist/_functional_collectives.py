"""Functional collectives (torch.distributed._functional_collectives) on DTensors.

torch's functional collectives take each rank's *local* tensor and return the rank's result. tfdist runs
one program for all devices, so the ranks' local tensors are the shards of a DTensor along one mesh dim
(the ``group``), and the result is a DTensor whose shard on each device is what torch's rank would get:

* ``all_reduce(x, "sum", group)``: every device's shard becomes the sum of the group's shards;
* ``all_gather_tensor(x, gather_dim, group)``: the group's shards concatenated along ``gather_dim``;
* ``reduce_scatter_tensor(x, "sum", scatter_dim, group)``: the sum, each device keeping its chunk;
* ``all_to_all_single(x, None, None, group)``: chunk j of device r's shard goes to device j, in r order;
* ``broadcast(x, src, group)``: every device's shard becomes device ``src``'s;
* ``all_gather_single`` (torch 2.13's name for ``all_gather_tensor`` along dim 0) and ``wait_tensor``.

How: the group's shards are viewed, with local reshapes only, as a tensor with a leading axis of one
entry per rank, sharded on the group's mesh dim -- exactly tfdist's physical form of a ``Partial``
DTensor -- and TF DTensor then does the collective (an all-reduce, a reduce-scatter as all-to-all + local
sum, an all-gather, an all-to-all): torch's bytes, inside ``tf.function`` and under ``GradientTape``.

``group`` is a one-dim mesh (``mesh["tp"]``) or ``(mesh, dim)``; a plain tensor stands for the same
tensor on every rank (as when each torch rank runs the line).
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._api import DTensor, distribute_tensor
from tfdist.tensor._layout import DTensorSpec
from tfdist.tensor._redistribute._moves import move_mesh_dim
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "all_to_all_single",
           "broadcast", "wait_tensor"]

_OPS = ("sum", "avg", "product", "max", "min")


def _group_dim(group: Any, caller: str) -> tuple[DeviceMesh, int]:
    """(root mesh, root mesh dim) of a group given as a 1-D mesh or (mesh, dim)."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        return mesh.root_mesh, mesh.root_dims[mesh._dim_index(dim)]
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise NotImplementedError(
                f"{caller}: a group over several mesh dims ({group!r}) has no single mesh dim to run on; give "
                "one, e.g. group=mesh['tp'] or group=(mesh, 'tp').")
        return group.root_mesh, group.root_dims[0]
    raise TypeError(f"{caller}: group must be a one-dim DeviceMesh (mesh['tp']) or (mesh, dim). "
                    f"Received: group={group!r}")


def _as_dtensor(x: Any, root: DeviceMesh, caller: str) -> DTensor:
    if isinstance(x, DTensor):
        if x.device_mesh.root_mesh != root:
            raise ValueError(f"{caller}: the tensor lives on {x.device_mesh!r}, the group on {root!r}.")
        return x if x.device_mesh == root else x.redistribute(root, x._spec.root_placements)
    # a plain tensor: the same tensor on every rank
    return distribute_tensor(tf.convert_to_tensor(x), root, [Replicate()] * root.ndim)


def _check(x: DTensor, m: int, caller: str) -> Placement:
    spec = x._spec
    p = spec.root_placements[m]
    if spec.multi_dims or spec.uneven_dims:
        raise ValueError(f"{caller}: each rank's tensor must be an even shard of one mesh dim; received a DTensor "
                         f"of shape {spec.shape} with placements {spec.placements}. Redistribute it first.")
    if any(q.is_partial() for i, q in enumerate(spec.root_placements) if i != m):
        raise ValueError(f"{caller}: the tensor is Partial on a mesh dim outside the group; reduce it first. "
                         f"Received placements {spec.placements}.")
    return p


def _alone_on(x: DTensor, m: int, dim: int, caller: str) -> None:
    """Refuses a rank tensor whose ``dim`` another mesh dim also shards (its chunks interleave with the
    group's in the global order, which the stacked view does not follow)."""
    others = [i for i, p in enumerate(x._spec.root_placements) if i != m and p == Shard(dim)]
    if others:
        names = [x.device_mesh.axis_names[i] for i in others]
        raise ValueError(f"{caller}: dim {dim} of the tensor is also sharded over mesh dim(s) {names}; "
                         f"redistribute it to Replicate there first. Received placements {x.placements}.")


def _specs(x: DTensor) -> list[str]:
    return list(x._spec.tf_layout.sharding_specs)


def _stacked(x: DTensor, m: int) -> tuple[tf.Tensor, tuple[int, ...]]:
    """The group's local tensors as one physical tensor with a leading rank axis sharded on mesh dim ``m``,
    and the local shape: local reshapes and relayouts only, no communication."""
    spec, root = x._spec, x.device_mesh
    k, name = root.shape[m], root.axis_names[m]
    mesh = root.to_tf()
    p = spec.root_placements[m]
    t, specs = x._physical, _specs(x)
    if p.is_partial():  # the physical form already leads with the rank axis
        return t, spec.shape
    if isinstance(p, Shard):
        d, shape = p.dim, list(t.shape)
        local = list(spec.shape)
        local[d] //= k
        t = tf.reshape(t, shape[:d] + [k, shape[d] // k] + shape[d + 1:])
        specs = specs[:d] + [name, dtensor.UNSHARDED] + specs[d + 1:]
        t = dtensor.relayout(t, dtensor.Layout(specs, mesh))
        perm = [d] + [i for i in range(len(specs)) if i != d]
        specs = [specs[i] for i in perm]
        return dtensor.relayout(tf.transpose(t, perm), dtensor.Layout(specs, mesh)), tuple(local)
    # Replicate: every rank holds the whole tensor; each device keeps its own copy of it
    t = tf.broadcast_to(tf.expand_dims(t, 0), [k] + list(t.shape))
    t = dtensor.relayout(t, dtensor.Layout([dtensor.UNSHARDED] + specs, mesh))
    return dtensor.relayout(t, dtensor.Layout([name] + specs, mesh)), spec.shape


def _placements(x: DTensor, m: int, p: Placement) -> list[Placement]:
    """x's placements with mesh dim ``m`` replaced by ``p`` (the local tensors' other shardings kept)."""
    out = list(x._spec.root_placements)
    out[m] = p
    return out


def _as_partial(x: DTensor, m: int, op: str) -> DTensor:
    """The group's local tensors as a Partial(op) DTensor on ``m`` whose global value is their reduction."""
    stacked, local = _stacked(x, m)
    spec = DTensorSpec(x.device_mesh, tuple(_placements(x, m, Partial(op))), tuple(local))
    return DTensor._wrap(dtensor.relayout(stacked, spec.tf_layout), spec)


def _op(reduce_op: str, caller: str) -> str:
    op = str(reduce_op).lower()
    if op not in _OPS:
        raise ValueError(f"{caller}: reduceOp must be one of {_OPS}. Received: reduceOp={reduce_op!r}")
    return op


def all_reduce(self: Any, reduceOp: str, group: Any, tag: str = "") -> DTensor:  # noqa: N803 (torch's name)
    """Every rank's tensor becomes the reduction (``reduceOp``) of the group's: one all-reduce.

    Example:
        >>> x = distribute_tensor(tf.reshape(tf.range(8.0), (8, 1)), mesh, [Shard(0)])   # rank r holds [[r]]
        >>> all_reduce(x, "sum", mesh).to_local()                                          # [[28.]]
    """
    root, m = _group_dim(group, "all_reduce")
    x = _as_dtensor(self, root, "all_reduce")
    _check(x, m, "all_reduce")
    return _as_partial(x, m, _op(reduceOp, "all_reduce")).redistribute(root, _placements(x, m, Replicate()))


def reduce_scatter_tensor(self: Any, reduceOp: str, scatter_dim: int, group: Any,  # noqa: N803
                          tag: str = "") -> DTensor:
    """The reduction of the group's tensors, rank r keeping chunk r along ``scatter_dim``: a reduce-scatter."""
    root, m = _group_dim(group, "reduce_scatter_tensor")
    x = _as_dtensor(self, root, "reduce_scatter_tensor")
    _check(x, m, "reduce_scatter_tensor")
    partial = _as_partial(x, m, _op(reduceOp, "reduce_scatter_tensor"))
    dim = _dim(scatter_dim, partial.ndim, "scatter_dim")
    if partial.shape[dim] % root.shape[m]:
        raise ValueError(f"reduce_scatter_tensor: dim {dim} of each rank's tensor ({partial.shape[dim]}) must divide "
                         f"by the group size {root.shape[m]}, as in torch.")
    return partial.redistribute(root, _placements(x, m, Shard(dim)))


def all_gather_tensor(self: Any, gather_dim: int, group: Any, tag: str = "") -> DTensor:
    """The group's tensors concatenated along ``gather_dim``, on every rank: one all-gather."""
    root, m = _group_dim(group, "all_gather_tensor")
    x = _as_dtensor(self, root, "all_gather_tensor")
    p = _check(x, m, "all_gather_tensor")
    if p.is_partial():
        raise ValueError("all_gather_tensor: a Partial DTensor's local tensors are partial values; reduce them "
                         "first (all_reduce) or gather its full_tensor().")
    dim = _dim(gather_dim, x.ndim, "gather_dim")
    if p == Shard(dim):  # the ranks' tensors are the chunks of x along that dim
        return x.redistribute(root, _placements(x, m, Replicate()))
    _alone_on(x, m, dim, "all_gather_tensor")
    stacked, local = _stacked(x, m)
    # rank axis next to the gather dim, then merged into it (the rank part major): Shard(dim) on m
    perm = list(range(1, dim + 1)) + [0] + list(range(dim + 1, len(local) + 1))
    mesh, specs = root.to_tf(), _stacked_specs(x, m, len(local))
    moved = [specs[i] for i in perm]
    t = dtensor.relayout(tf.transpose(stacked, perm), dtensor.Layout(moved, mesh))
    shape = list(local)
    shape[dim] *= root.shape[m]
    spec = DTensorSpec(root, tuple(_placements(x, m, Shard(dim))), tuple(shape))
    merged = tf.reshape(t, list(spec.physical_shape))
    gathered = DTensor._wrap(dtensor.relayout(merged, spec.tf_layout), spec)
    return gathered.redistribute(root, _placements(x, m, Replicate()))


def all_gather_single(self: Any, group: Any, tag: str = "") -> DTensor:
    """torch 2.13's name for ``all_gather_tensor(self, 0, group)``."""
    return all_gather_tensor(self, 0, group, tag)


def all_to_all_single(self: Any, output_split_sizes: Sequence[int] | None, input_split_sizes: Sequence[int] | None,
                      group: Any, tag: str = "") -> DTensor:
    """Chunk j (along dim 0) of rank r's tensor goes to rank j, which concatenates them in rank order: one
    all-to-all.  Equal splits only (``None``, or every size equal)."""
    root, m = _group_dim(group, "all_to_all_single")
    x = _as_dtensor(self, root, "all_to_all_single")
    p = _check(x, m, "all_to_all_single")
    k = root.shape[m]
    stacked, local = _stacked(x, m)
    for name, sizes in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
        if sizes is not None and (len(sizes) != k or len(set(sizes)) != 1 or sum(sizes) != local[0]):
            raise NotImplementedError(
                f"all_to_all_single: {name} must be None or {k} equal sizes summing to dim 0 ({local[0]}); "
                f"ragged splits give each rank a different shape, which a DTensor's shards cannot. "
                f"Received: {name}={list(sizes)}")
    _alone_on(x, m, 0, "all_to_all_single")
    if p.is_partial() or local[0] % k:
        raise ValueError(f"all_to_all_single: each rank's tensor must be a shard or a copy, with dim 0 "
                         f"({local[0]}) dividing by the group size {k}.")
    mesh, specs = root.to_tf(), _stacked_specs(x, m, len(local))
    t = tf.reshape(stacked, [k, k, local[0] // k] + list(stacked.shape[2:]))
    specs = [specs[0], dtensor.UNSHARDED, specs[1]] + specs[2:]
    t = dtensor.relayout(t, dtensor.Layout(specs, mesh))
    perm = [1, 0] + list(range(2, len(specs)))
    specs = [specs[i] for i in perm]
    t = dtensor.relayout(tf.transpose(t, perm), dtensor.Layout(specs, mesh))
    t, specs = move_mesh_dim(t, specs, 1, 0, mesh)  # the all-to-all: receivers take the rank axis
    shape = [k * local[0]] + list(local[1:])
    spec = DTensorSpec(root, tuple(_placements(x, m, Shard(0))), tuple(shape))
    return DTensor._wrap(dtensor.relayout(tf.reshape(t, list(spec.physical_shape)), spec.tf_layout), spec)


def broadcast(self: Any, src: int, group: Any, tag: str = "") -> DTensor:
    """Every rank's tensor becomes rank ``src``'s (its position along the group's mesh dim)."""
    root, m = _group_dim(group, "broadcast")
    x = _as_dtensor(self, root, "broadcast")
    _check(x, m, "broadcast")
    k = root.shape[m]
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < k:
        raise ValueError(f"broadcast: src must be a rank of the group, 0..{k - 1}. Received: src={src!r}")
    partial = _as_partial(x, m, "sum")
    mask = tf.reshape(tf.one_hot(src, k, dtype=partial.dtype), [k] + [1] * partial.ndim)
    if tf.executing_eagerly():
        mask = dtensor.copy_to_mesh(mask, dtensor.Layout.replicated(root.to_tf(), partial.ndim + 1))
    kept = DTensor._wrap(dtensor.relayout(partial._physical * mask, partial._spec.tf_layout), partial._spec)
    return kept.redistribute(root, _placements(x, m, Replicate()))


def wait_tensor(tensor: Any) -> Any:
    """torch waits for an async collective here; TF waits where a value is used, so this returns it."""
    return tensor


def _dim(dim: int, ndim: int, name: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{name} must be a dim of each rank's tensor, -{ndim}..{ndim - 1}. Received: {name}={dim!r}")
    return dim % ndim


def _stacked_specs(x: DTensor, m: int, local_ndim: int) -> list[str]:
    """The sharding specs of ``_stacked(x, m)``: the rank axis on m, then each local dim as x shards it."""
    names = x.device_mesh.axis_names
    specs = [names[m]] + [dtensor.UNSHARDED] * local_ndim
    for i, p in enumerate(x._spec.root_placements):
        if i != m and isinstance(p, Shard):
            specs[1 + p.dim] = names[i]
    return specs
