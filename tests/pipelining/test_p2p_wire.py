"""What a pipeline boundary between clients carries (tfdist/pipelining/_p2p.py): a DTensor's distinct
local shards between congruent sub-meshes, packed into the same layout on the receiving mesh, else the
whole tensor. One process holds both meshes here (the 4-client run is tests/multiclient/pipeline_gpt_3d.py);
references are numpy slices of the tensor sent."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.pipelining._p2p import _header, _metas, from_wire, to_wire
from tfdist.pipelining.schedules import _congruent, _Place


def _meshes() -> tuple[dtensor.Mesh, dtensor.Mesh]:
    return tuple(DeviceMesh("cpu", [[4 * g, 4 * g + 1], [4 * g + 2, 4 * g + 3]], mesh_dim_names=("dp", "tp")).to_tf()
                 for g in range(2))


def _sharded(x: np.ndarray, mesh: dtensor.Mesh, specs: list[str]) -> tf.Tensor:
    t = dtensor.copy_to_mesh(tf.constant(x), dtensor.Layout.replicated(mesh, x.ndim))
    return dtensor.relayout(t, dtensor.Layout(specs, mesh))


def test_a_dp_sharded_tensor_crosses_as_its_dp_halves_once_and_lands_in_the_same_layout():
    a, b = _meshes()
    x = np.arange(8 * 6, dtype=np.float64).reshape(8, 6)
    wire = to_wire(_sharded(x, a, ["dp", dtensor.UNSHARDED]), a)
    assert wire.spec == (0, -1) and wire.shape == (8, 6)
    # the tp replicas are not sent twice: one part per dp coordinate, in coordinate order
    assert [p.numpy().tolist() for p in wire.shards] == [x[:4].tolist(), x[4:].tolist()]
    got = from_wire(wire, b)
    assert dtensor.fetch_layout(got) == dtensor.Layout(["dp", dtensor.UNSHARDED], b)
    np.testing.assert_array_equal(dtensor.unpack(got)[2].numpy(), x[4:])  # device 6 is dp row 1
    whole = dtensor.relayout(got, dtensor.Layout.replicated(b, 2))
    np.testing.assert_array_equal(dtensor.unpack(whole)[0].numpy(), x)


def test_a_tensor_sharded_over_both_dims_crosses_as_its_four_blocks():
    a, b = _meshes()
    x = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    wire = to_wire(_sharded(x, a, ["tp", "dp"]), a)
    assert wire.spec == (1, 0) and [tuple(p.shape) for p in wire.shards] == [(2, 4)] * 4
    got = from_wire(wire, b)
    assert dtensor.fetch_layout(got) == dtensor.Layout(["tp", "dp"], b)
    # the device at mesh coordinate (dp, tp) holds rows tp, columns dp of x, as on the sending mesh
    for (dp, tp), part in zip([(0, 0), (0, 1), (1, 0), (1, 1)], dtensor.unpack(got)):
        np.testing.assert_array_equal(part.numpy(), x[2 * tp:2 * tp + 2, 4 * dp:4 * dp + 4])


def test_other_pairs_and_plain_tensors_carry_the_whole_tensor():
    a, b = _meshes()
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    wire = to_wire(_sharded(x, a, ["dp", dtensor.UNSHARDED]), None)
    assert wire.spec == (-1, -1) and len(wire.shards) == 1
    np.testing.assert_array_equal(from_wire(wire, b).numpy(), x)
    on_another_mesh = to_wire(_sharded(x, b, ["dp", dtensor.UNSHARDED]), a)  # not the stage's mesh: whole
    assert on_another_mesh.spec == (-1, -1)
    np.testing.assert_array_equal(on_another_mesh.shards[0].numpy(), x)
    plain = to_wire(tf.constant(x), a)
    assert plain.spec == (-1, -1)
    np.testing.assert_array_equal(from_wire(plain, None).numpy(), x)


def test_the_header_tells_the_receiver_each_part_shape_and_count():
    a, b = _meshes()
    wires = (to_wire(_sharded(np.zeros((8, 6)), a, ["dp", dtensor.UNSHARDED]), a),
             to_wire(tf.zeros((3,), tf.int32), a))
    coordinates = [(0, 0), (0, 1), (1, 0), (1, 1)]  # one client holding the whole receiving mesh
    metas = _metas(_header(wires), b.shape(), coordinates)
    assert metas == [((8, 6), tf.float64, (0, -1), [4, 6], 2), ((3,), tf.int32, (-1,), [3], 1)]


def _place(client_devices: dict[int, list[int]], shape: list[int], ids: list[int]) -> _Place:
    name = "/job:worker/replica:0/task:{}/device:CPU:{}".format
    devices = [name(i // 2, i % 2) for i in ids]
    return _Place(tuple((c, tuple(name(i // 2, i % 2) for i in held)) for c, held in client_devices.items()),
                  (["dp", "tp"], shape, devices))


def test_client_pairs_are_congruent_when_they_hold_the_same_coordinates_of_one_mesh_shape():
    a = _place({0: [0, 1], 1: [2, 3]}, [2, 2], [0, 1, 2, 3])
    b = _place({2: [4, 5], 3: [6, 7]}, [2, 2], [4, 5, 6, 7])
    assert a.coordinates_of(1) == [(1, 0), (1, 1)]
    assert _congruent(a, 0, b, 2) and _congruent(a, 1, b, 3)
    assert not _congruent(a, 0, b, 3)  # client 3 holds dp row 1 of its mesh, client 0 row 0
    assert not _congruent(a, 0, _place({2: [4, 5], 3: [6, 7]}, [4, 1], [4, 5, 6, 7]), 2)
    assert not _congruent(a, 0, _Place(((2, ("/job:worker/replica:0/task:2/device:CPU:0",)),)), 2)
