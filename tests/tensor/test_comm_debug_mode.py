"""CommDebugMode counts the collectives TensorFlow executes (from the profiler trace)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from conftest import make_mesh
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.debug._comm_mode import classify_kernel

MESH_1D = make_mesh((8,))
MESH = make_mesh((2, 4))
X = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)

# What runs per device: torch's collective for each transition.
CPU_TRANSITIONS = [
    ([Shard(0)], [Replicate()], {"all_gather_into_tensor": 1}),
    ([Shard(0)], [Shard(1)], {"all_to_all_single": 1}),
    ([Replicate()], [Shard(0)], {}),                  # a local slice
    ([Shard(1)], [Shard(1)], {}),
]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("src, dst, want", CPU_TRANSITIONS, ids=lambda v: str(v))
def test_shard_replicate_transitions(src, dst, want, graph):
    d = distribute_tensor(X, MESH_1D, src)
    move = (lambda t: t.redistribute(MESH_1D, dst))
    if graph:
        move = tf.function(move)
        move(d)  # trace and warm up outside the counted window
    with CommDebugMode() as comm:
        out = move(d)
    np.testing.assert_array_equal(out.numpy(), X)
    assert comm.get_comm_counts() == want
    assert comm.get_total_counts() == sum(want.values())


@pytest.mark.parametrize(
    "dst, want",
    [(Replicate(), {"all_reduce": 1}), (Shard(0), {"reduce_scatter_tensor": 1})],
    ids=str,
)
def test_partial_resolves_with_one_collective(dst, want):
    parts = [np.full((8, 4), c[1], np.float32) for c in MESH.local_coordinates()]
    p = DTensor.from_local(parts, MESH, [Replicate(), Partial()])
    with CommDebugMode() as comm:
        out = p.redistribute(MESH, [Replicate(), dst])
    np.testing.assert_array_equal(out.numpy(), np.full((8, 4), 6.0))
    assert comm.get_comm_counts() == want


def test_counts_are_per_device_on_a_mesh_smaller_than_the_client():
    """Two all-gathers on a 4-device mesh of an 8-device client are 2, not 1 (no division by 8)."""
    small = tfdist.DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("x",))
    d = distribute_tensor(X, small, [Shard(0)])
    with CommDebugMode() as comm:
        d.redistribute(small, [Replicate()])
        d.redistribute(small, [Replicate()])
    assert comm.get_comm_counts() == {"all_gather_into_tensor": 2}


def test_megatron_mlp_forward_has_one_all_reduce():
    x = distribute_tensor(np.ones((8, 16), np.float32), MESH, [Shard(0), Replicate()])
    w1 = distribute_tensor(np.ones((16, 32), np.float32), MESH, [Replicate(), Shard(1)])
    w2 = distribute_tensor(np.ones((32, 16), np.float32), MESH, [Replicate(), Shard(0)])
    mlp = tf.function(lambda x, a, b: tf.nn.relu(x @ a) @ b)
    mlp(x, w1, w2)
    with CommDebugMode() as comm:
        y = mlp(x, w1, w2)
    assert tuple(y.placements) == (Shard(0), Partial())  # the row-parallel product stays Partial (torch)
    assert comm.get_comm_counts() == {}
    with CommDebugMode() as comm:
        full = y.redistribute(MESH, [Shard(0), Replicate()])
    np.testing.assert_array_equal(full.numpy(), np.full((8, 16), 16.0 * 32))
    assert comm.get_comm_counts() == {"all_reduce": 1}


def test_module_attribution_and_table():
    d = distribute_tensor(X, MESH, [Shard(0), Shard(1)])
    with CommDebugMode() as comm:
        d.redistribute(MESH, [Shard(0), Replicate()])
        with comm.module("block0.mlp"):
            d.redistribute(MESH, [Replicate(), Shard(1)])
            d + 1.0  # local: no collective
    # torch's shape: per module and pass; Global holds everything
    assert comm.get_comm_module_counts() == {
        "Global": {"forward": {"all_gather_into_tensor": 2}, "backward": {}},
        "block0.mlp": {"forward": {"all_gather_into_tensor": 1}, "backward": {}},
    }
    table = comm.generate_comm_debug_tracing_table(noise_level=2)
    assert "block0.mlp" in table and "CollectiveGatherV2" in table
    assert "total: 2 collective(s) per device" in table


def test_keras_layers_get_their_collectives_forward_and_backward_as_megatron_places_them(tmp_path):
    """A tensor-parallel GPT's train step: the executed program's name scopes put each all-reduce in
    the layer that needed it -- forward in the row-parallel layers (attention output, MLP down, the
    row-parallel embedding), backward in the column-parallel MLP up (its input gradient): Megatron's
    pattern, derived by hand. Parameters and the JSON dump follow torch's structure."""
    import json

    import keras

    from tfdist.keras import _data
    from tfdist.models import GPT, parallelize_gpt

    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = GPT(32, 8, dim=32, heads=4, depth=1)
    parallelize_gpt(model, mesh)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = np.random.default_rng(0).integers(0, 32, (16, 8))
    model.fit(ids, ids, batch_size=16, epochs=1, verbose=0)
    step = model.make_train_function()
    with CommDebugMode() as comm:
        step(iter([_data.shard_batch((tf.constant(ids), tf.constant(ids)), mesh, 0)]))
    counts = comm.get_comm_module_counts()
    for row_parallel in ("GPT.blocks.0.attn.output", "GPT.blocks.0.mlp.down", "GPT.tok"):
        assert counts[row_parallel]["forward"] == {"all_reduce": 1}, (row_parallel, counts)
    # backward: its input gradient over tp (Megatron's one), and its kernel's and bias's gradients over dp
    # (data parallelism, one all-reduce each: tfdist turns off TF DTensor's all-reduce combining,
    # docs/design.md)
    assert counts["GPT.blocks.0.mlp.up"] == {"forward": {}, "backward": {"all_reduce": 3}}
    assert counts["GPT.blocks.0.mlp.down"]["backward"] == {"all_reduce": 2}  # its kernel and bias over dp
    assert counts["GPT.blocks.0.mlp"]["forward"] == {"all_reduce": 1}  # a parent includes its children
    total = comm.get_comm_counts()["all_reduce"]
    assert sum(counts["Global"]["forward"].values()) + sum(counts["Global"]["backward"].values()) == total
    params = comm.get_parameter_info()
    assert params["GPT.blocks.0.mlp.up"]["kernel"] == (Replicate(), Shard(1))  # column parallel on tp
    assert params["GPT.blocks.0.mlp.down"]["kernel"] == (Replicate(), Shard(0))  # row parallel on tp
    assert comm.get_sharding_info()["GPT.blocks.0.mlp.up.kernel"] == (Replicate(), Shard(1))
    table = comm.generate_comm_debug_tracing_table(noise_level=1)
    assert "GPT.blocks.0.mlp.down\n" in table and "*module type: Dense" in table and "BACKWARD PASS" in table
    comm.generate_json_dump(str(tmp_path / "comm.json"))
    root = json.loads((tmp_path / "comm.json").read_text())
    assert root["fqn"] == "Global" and [c["fqn"] for c in root["children"]] == ["GPT"]
    blocks = {c["fqn"]: c for c in root["children"][0]["children"]}
    mlp = {c["fqn"]: c for c in blocks["GPT.blocks.0"]["children"]}["GPT.blocks.0.mlp"]
    up = {c["fqn"]: c for c in mlp["children"]}["GPT.blocks.0.mlp.up"]
    assert up["module_type"] == "Dense" and ["kernel", "(Replicate(), Shard(dim=1))"] in up["parameters"]
    assert up["collectives_backward"] == [["all_reduce", 3]] and up["collectives_forward"] == []


def test_kernel_classification():
    assert classify_kernel("CollectiveReduceV2") == "all_reduce"
    assert classify_kernel("CollectiveGatherV2") == "all_gather_into_tensor"
    assert classify_kernel("CollectiveAllToAllV2") == "all_to_all_single"
    assert classify_kernel("CollectiveReduceScatterV2") == "reduce_scatter_tensor"
    assert classify_kernel("CollectiveBcastSendV2") == "broadcast"
    assert classify_kernel("NcclAllReduce") == "all_reduce"
    assert classify_kernel("MatMul") is None and classify_kernel("GatherV2") is None


def test_nested_modes_are_refused():
    with CommDebugMode():
        with pytest.raises(RuntimeError, match="profiler, which is already running"):
            with CommDebugMode():
                pass


# Bytes a device sends, worked out by hand with ring costs (N = the tensor's bytes, k devices):
# all-gather (k-1)/k N, all-to-all (k-1)/k^2 N, reduce-scatter (k-1)/k N, all-reduce 2(k-1)/k N.
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize(
    "src, dst, name, sent",
    [
        ([Shard(0)], [Replicate()], "all_gather_into_tensor", 7 / 8 * 512),
        ([Shard(0)], [Shard(1)], "all_to_all_single", 7 / 64 * 512),
    ],
    ids=["gather", "all_to_all"],
)
def test_bytes_are_read_from_the_executed_programs(src, dst, name, sent, graph):
    d = distribute_tensor(X, MESH_1D, src)  # 16 x 8 float32: 512 bytes
    move = (lambda t: t.redistribute(MESH_1D, dst))
    if graph:
        move = tf.function(move)
    move(d)
    with CommDebugMode() as comm:
        for _ in range(3):
            move(d)
    assert comm.get_comm_counts() == {name: 3}
    assert comm.get_comm_bytes() == {name: pytest.approx(3 * sent)}
    assert comm.get_unmeasured_counts() == {}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize(
    "dst, name, sent",
    [(Replicate(), "all_reduce", 2 * 3 / 4 * 128), (Shard(0), "reduce_scatter_tensor", 3 / 4 * 128)],
    ids=["all_reduce", "reduce_scatter"],
)
def test_partial_moves_are_torch_collectives_with_their_bytes(dst, name, sent, graph):
    parts = [np.full((8, 4), c[1], np.float32) for c in MESH.local_coordinates()]  # 128 bytes
    p = DTensor.from_local(parts, MESH, [Replicate(), Partial()])
    move = (lambda t: t.redistribute(MESH, [Replicate(), dst]))
    if graph:
        move = tf.function(move)
        move(p)
    with CommDebugMode() as comm:
        out = move(p)
    np.testing.assert_array_equal(out.numpy(), np.full((8, 4), 6.0))
    assert comm.get_comm_counts() == {name: 1}
    assert comm.get_comm_bytes() == {name: pytest.approx(sent)}


@pytest.mark.parametrize("dtype, itemsize", [(tf.float64, 8), (tf.bfloat16, 2), (tf.int32, 4)])
def test_bytes_follow_the_dtype_that_travelled(dtype, itemsize):
    """bfloat16 travels as float16 bits (same size): the executed kernel's dtype decides."""
    d = distribute_tensor(tf.cast(X, dtype), MESH_1D, [Shard(0)])
    gather = tf.function(lambda t: t.full_tensor())
    gather(d)
    with CommDebugMode() as comm:
        gather(d)
    assert comm.get_comm_bytes() == {"all_gather_into_tensor": pytest.approx(7 / 8 * X.size * itemsize)}


def test_the_backward_of_a_reduce_scatter_is_not_one():
    """torch: Partial -> Shard forward is a reduce-scatter; its backward moves the gradient
    back to every partial (tfdist: the all-to-all back), which is not counted as one."""
    parts = [np.full((8, 4), 1.0, np.float32) for _ in MESH.local_coordinates()]
    p = DTensor.from_local(parts, MESH, [Replicate(), Partial()])

    @tf.function
    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = t.redistribute(MESH, [Replicate(), Shard(0)])
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, t)

    step(p)
    with CommDebugMode() as comm:
        step(p)
    assert comm.get_comm_counts().get("reduce_scatter_tensor") == 1, comm.get_comm_counts()
    assert comm.get_comm_counts().get("all_to_all_single", 0) >= 1, comm.get_comm_counts()
