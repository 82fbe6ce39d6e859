"""Functional collectives (torch.distributed._functional_collectives): each device's shard of the result is
what torch's rank gets from its local tensor, checked per device against numpy; torch's collective per call
(CommDebugMode); inside tf.function and under GradientTape."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist._functional_collectives as fc
from tfdist.tensor import DTensor, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode

MESH = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
X = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
COORDS = [tuple(c) for c in MESH.local_coordinates()]
PLACEMENTS = [[Shard(1), Shard(0)], [Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Shard(1)],
              [Replicate(), Replicate()]]


def _group(i: int) -> list[int]:
    """The devices of device i's tp group (torch's ranks of that process group), in rank order."""
    return [j for j, c in enumerate(COORDS) if c[0] == COORDS[i][0]]


def _locals(t: DTensor) -> list[np.ndarray]:
    return [a.numpy() for a in t.local_tensors()]


def _check(result: DTensor, want) -> None:
    got = _locals(result)
    for i in range(len(got)):
        np.testing.assert_allclose(got[i], want(i), rtol=1e-6, err_msg=f"device {i}")


@pytest.mark.parametrize("placements", PLACEMENTS, ids=lambda p: "".join(map(repr, p)))
def test_each_device_gets_what_its_torch_rank_gets(placements):
    x = distribute_tensor(X, MESH, placements)
    loc = _locals(x)
    rank = [COORDS[i][1] for i in range(8)]
    _check(fc.all_reduce(x, "sum", MESH["tp"]), lambda i: sum(loc[j] for j in _group(i)))
    _check(fc.all_gather_tensor(x, 0, MESH["tp"]), lambda i: np.concatenate([loc[j] for j in _group(i)], 0))
    _check(fc.all_gather_single(x, MESH["tp"]), lambda i: np.concatenate([loc[j] for j in _group(i)], 0))
    _check(fc.reduce_scatter_tensor(x, "max", 1, (MESH, "tp")),
           lambda i: np.split(np.max([loc[j] for j in _group(i)], 0), 4, 1)[rank[i]])
    _check(fc.broadcast(x, 2, MESH["tp"]), lambda i: loc[_group(i)[2]])
    if placements[0] != Shard(1):  # dim 1 free of dp: gather along it
        _check(fc.all_gather_tensor(x, 1, MESH["tp"]), lambda i: np.concatenate([loc[j] for j in _group(i)], 1))
    if loc[0].shape[0] % 4 == 0:
        _check(fc.all_to_all_single(x, None, None, MESH["tp"]),
               lambda i: np.concatenate([np.split(loc[j], 4, 0)[rank[i]] for j in _group(i)], 0))


def test_torchs_collective_runs_once_per_call_inside_tf_function():
    x = distribute_tensor(X, MESH, [Replicate(), Shard(1)])
    calls = {"all_reduce": lambda t: fc.all_reduce(t, "sum", MESH["tp"]),
             "reduce_scatter_tensor": lambda t: fc.reduce_scatter_tensor(t, "sum", 0, MESH["tp"]),
             "all_gather_into_tensor": lambda t: fc.all_gather_tensor(t, 1, MESH["tp"]),
             "all_to_all_single": lambda t: fc.all_to_all_single(t, [2, 2, 2, 2], None, MESH["tp"])}
    for name, call in calls.items():
        fn = tf.function(call)
        eager = _locals(call(x))
        fn(x)
        with CommDebugMode() as comm:
            traced = fn(x)
        traced = traced if isinstance(traced, DTensor) else DTensor.from_tf(traced)
        for a, b in zip(_locals(traced), eager):
            np.testing.assert_allclose(a, b)
        assert comm.get_comm_counts() == {name: 1}, (name, comm.get_comm_counts())


def test_gradients_flow_through_as_torchs_backward():
    """d/dx of sum(all_reduce(x)) is one per element (the all-reduced value is one global value); of
    sum(all_gather(x)) too; of sum(reduce_scatter(x) ** 2) it is 2 * the reduced value at each position."""
    x = distribute_tensor(X, MESH, [Replicate(), Shard(1)])
    for call, want in ((lambda t: fc.all_reduce(t, "sum", MESH["tp"]), np.ones_like(X)),
                       (lambda t: fc.all_gather_tensor(t, 1, MESH["tp"]), np.ones_like(X))):
        with tf.GradientTape() as tape:
            tape.watch(x._physical)
            loss = tf.reduce_sum(call(x))
        np.testing.assert_allclose(DTensor._wrap(tape.gradient(loss, x._physical), x._spec).numpy(), want)
    with tf.GradientTape() as tape:
        tape.watch(x._physical)
        loss = tf.reduce_sum(fc.reduce_scatter_tensor(x, "sum", 0, MESH["tp"]) ** 2)
    reduced = sum(np.split(X, 4, 1))  # the ranks' 8 x 4 tensors summed
    np.testing.assert_allclose(DTensor._wrap(tape.gradient(loss, x._physical), x._spec).numpy(),
                               np.tile(2 * reduced, (1, 4)))


def test_plain_tensors_are_every_ranks_tensor_and_bad_input_is_named():
    y = fc.all_reduce(tf.ones((2, 3)), "sum", MESH["tp"])  # each of 4 ranks contributes ones
    np.testing.assert_array_equal(_locals(y)[0], np.full((2, 3), 4.0))
    assert fc.wait_tensor(y) is y
    x = distribute_tensor(X, MESH, [Shard(1), Shard(0)])
    with pytest.raises(NotImplementedError, match="group over several mesh dims"):
        fc.all_reduce(x, "sum", MESH)
    with pytest.raises(TypeError, match="group must be a one-dim DeviceMesh"):
        fc.all_reduce(x, "sum", [0, 1, 2, 3])
    with pytest.raises(ValueError, match="reduceOp must be one of"):
        fc.all_reduce(x, "mean", MESH["tp"])
    with pytest.raises(ValueError, match="dim 1 of the tensor is also sharded over mesh dim"):
        fc.all_gather_tensor(x, 1, MESH["tp"])
    with pytest.raises(NotImplementedError, match="ragged splits"):
        fc.all_to_all_single(distribute_tensor(X, MESH, [Replicate(), Replicate()]), [1, 3, 2, 2], None, MESH["tp"])
    with pytest.raises(ValueError, match="src must be a rank of the group, 0..3"):
        fc.broadcast(x, 4, MESH["tp"])
