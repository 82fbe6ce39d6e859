from __future__ import annotations

import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfdist
from tfdist import DeviceMesh, init_device_mesh
from tfdist.tensor import Shard, distribute_tensor


def test_shape_names_size(mesh_2d):
    assert mesh_2d.ndim == 2 and mesh_2d.shape == (2, 4)
    assert mesh_2d.mesh_dim_names == ("dp", "tp")
    assert mesh_2d.size() == 8 and mesh_2d.size(1) == 4 and mesh_2d.size("dp") == 2
    assert mesh_2d.device_type == "cpu"
    np.testing.assert_array_equal(mesh_2d.mesh, np.arange(8).reshape(2, 4))


def test_coordinates_and_local_rank(mesh_2d):
    assert mesh_2d.get_coordinate() == [0, 0]
    assert mesh_2d.local_coordinates()[5] == [1, 1]
    assert mesh_2d.get_local_rank("tp") == 0
    assert len(mesh_2d.local_devices()) == 8


def test_slicing_keeps_parent(mesh_2d):
    tp = mesh_2d["tp"]
    assert tp.shape == (4,) and tp.mesh_dim_names == ("tp",)
    assert tp.root_mesh == mesh_2d
    np.testing.assert_array_equal(tp.mesh, [0, 1, 2, 3])  # group of this client's first device
    np.testing.assert_array_equal(mesh_2d["dp"].mesh, [0, 4])
    assert mesh_2d["dp", "tp"] == mesh_2d
    assert mesh_2d["tp"] == mesh_2d["tp"] and hash(mesh_2d["tp"]) == hash(mesh_2d["tp"])
    assert mesh_2d["tp"] != mesh_2d["dp"]


def test_slice_placements_compose_on_parent(mesh_2d):
    x = np.arange(32.0).reshape(4, 8)
    col = distribute_tensor(x, mesh_2d["tp"], [Shard(1)])
    assert col.device_mesh == mesh_2d["tp"]
    both = col.redistribute(mesh_2d["dp"], [Shard(0)])
    assert both.device_mesh == mesh_2d and both.placements == (Shard(0), Shard(1))
    np.testing.assert_array_equal(both.numpy(), x)
    # device (1, 2) holds rows 2:4 and cols 4:6
    np.testing.assert_array_equal(both.local_tensors()[6].numpy(), x[2:4, 4:6])


def test_repr_and_equality():
    a = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    b = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert a == b and hash(a) == hash(b)
    assert repr(a) == "DeviceMesh('cpu', [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=('dp', 'tp'))"
    assert a != init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))


def test_unnamed_mesh():
    m = init_device_mesh("cpu", (8,))
    assert m.mesh_dim_names is None
    with pytest.raises(KeyError, match="no mesh_dim_names"):
        m["x"]


def test_explicit_device_order():
    m = DeviceMesh("cpu", [[0, 2, 4, 6], [1, 3, 5, 7]], mesh_dim_names=("a", "b"))
    np.testing.assert_array_equal(m.mesh, [[0, 2, 4, 6], [1, 3, 5, 7]])
    # Local views are in mesh order: the second cell (0, 1) holds device 2.
    assert m.local_device_ids()[:3] == [0, 2, 4]
    assert m.local_coordinates()[1] == [0, 1]
    assert m.local_devices()[1].endswith("CPU:2")
    x = np.arange(16.0).reshape(2, 8)
    d = distribute_tensor(x, m, [Shard(0), Shard(1)])
    np.testing.assert_array_equal(d.local_tensors()[1].numpy(), x[0:1, 2:4])
    np.testing.assert_array_equal(d.numpy(), x)


def test_tf_interop_round_trip(mesh_2d):
    tf_mesh = mesh_2d.to_tf()
    assert isinstance(tf_mesh, dtensor.Mesh)
    back = DeviceMesh.from_tf(tf_mesh)
    assert back == mesh_2d
    raw = dtensor.create_mesh([("x", 8)], device_type="CPU")
    assert DeviceMesh.from_tf(raw).mesh_dim_names == ("x",)


def test_gpu_alias_normalised():
    from tfdist._runtime import normalize_device_type

    assert normalize_device_type("cuda") == "GPU" and normalize_device_type("TPU") == "TPU"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(device_type="cpu", mesh_shape=(3, 3)), r"holds 9 devices but there are 8"),
        (dict(device_type="cpu", mesh_shape=(2, 4), mesh_dim_names=("a", "a")), "must be unique"),
        (dict(device_type="cpu", mesh_shape=(2, 4), mesh_dim_names=("a",)), "has 1 entries but the mesh has 2"),
        (dict(device_type="npu", mesh_shape=(8,)), "device_type must be one of"),
        (dict(device_type="cpu", mesh_shape=(8, 0)), "positive ints"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_device_mesh(**kwargs)


def test_bad_slice_and_dims(mesh_2d):
    with pytest.raises(KeyError, match="must be distinct dims"):
        mesh_2d["pp"]
    with pytest.raises(KeyError, match="mesh's order"):
        mesh_2d["tp", "dp"]
    with pytest.raises(ValueError, match="mesh_dim 'pp' is not a dim"):
        mesh_2d.size("pp")
    with pytest.raises(ValueError, match="distinct CPU device ids in 0..7"):
        DeviceMesh("cpu", [0, 1, 1, 3])


def test_virtual_cpus_same_count_is_harmless():
    assert len(tfdist.virtual_cpus(8)) == 8
    with pytest.raises(ValueError, match="positive int"):
        tfdist.virtual_cpus(0)


def test_device_ids_falling_along_a_dim_are_refused_while_tf_gathers_by_device_order():
    """TF's CollectiveGatherV2 lowering (on in tfdist) puts gathered parts in device order: on
    [[6, 7], [4, 5]] a Shard(0) tensor came back with its halves swapped. The mesh is refused, naming it."""
    with pytest.raises(ValueError, match=r"increase along every mesh dim \(dim 0 does not\).*"
                                         r"TFDIST_GATHER_LOWERING=reduce.*mesh=\[\[6, 7\], \[4, 5\]\]"):
        DeviceMesh("cpu", [[6, 7], [4, 5]], mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="dim 1 does not"):
        DeviceMesh("cpu", [[1, 0], [3, 2]])


@pytest.mark.slow
def test_gather_order_repro_and_the_reduce_lowering_way_out():
    """docs/tf_dtensor_repros/gather_lowering_device_order.py reproduces the wrong values in raw TF;
    with TFDIST_GATHER_LOWERING=reduce tfdist accepts the mesh and gathers right (numpy reference)."""
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "docs" / "tf_dtensor_repros" / "gather_lowering_device_order.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert "(2, 3, 0, 1): WRONG values, no error" in out.stdout
    program = (
        "import numpy as np, tfdist\n"
        "tfdist.virtual_cpus(8)\n"
        "from tfdist.tensor import Shard, Replicate, distribute_tensor\n"
        "m = tfdist.DeviceMesh('cpu', [[6, 7], [4, 5]], mesh_dim_names=('dp', 'tp'))\n"
        "x = np.arange(32.0).reshape(8, 4)\n"
        "d = distribute_tensor(x, m, [Shard(0), Replicate()])\n"
        "assert np.array_equal(d.full_tensor().numpy(), x)\n"
        "assert np.array_equal(d.local_tensors()[0].numpy(), x[:4])\n"
        "print('OK')\n"
    )
    env = dict(os.environ, TFDIST_GATHER_LOWERING="reduce")
    env.pop("LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2", None)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def test_get_group_is_the_one_dim_mesh_functional_collectives_take(mesh_2d):
    """torch's get_group(mesh_dim): here the 1-D mesh along that dim. An all-reduce over
    get_group("tp") sums each dp row's four shards (numpy reference)."""
    import tfdist._functional_collectives as fc

    assert mesh_2d.get_group("tp") == mesh_2d["tp"] and mesh_2d.get_group(0) == mesh_2d["dp"]
    assert mesh_2d.get_group(-1).shape == (4,) and mesh_2d.get_all_groups() == [mesh_2d["dp"], mesh_2d["tp"]]
    assert mesh_2d["tp"].get_group() == mesh_2d["tp"]
    with pytest.raises(ValueError, match="mesh_dim is required for a 2-D mesh"):
        mesh_2d.get_group()
    with pytest.raises(ValueError, match="mesh_dim 'pp' is not a dim"):
        mesh_2d.get_group("pp")
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    d = distribute_tensor(x, mesh_2d, [Shard(0), Shard(1)])  # device (i, j): rows 4i.., columns 4j..
    summed = fc.all_reduce(d, "sum", mesh_2d.get_group("tp"))
    for (i, j), local in zip([(i, j) for i in range(2) for j in range(4)], summed.local_tensors()):
        want = sum(x[4 * i:4 * i + 4, 4 * k:4 * k + 4] for k in range(4))
        np.testing.assert_array_equal(local.numpy(), want, err_msg=f"device ({i}, {j})")
    unnamed = DeviceMesh("cpu", np.arange(8).reshape(2, 4))
    assert unnamed.get_group(1).shape == (4,) and unnamed.get_group(1).mesh_dim_names is None
