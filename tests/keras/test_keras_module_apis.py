"""distribute_module and context_parallel on Keras layers, against unsharded Keras."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.keras._data import gather_to_numpy, shard_batch
from tfdist.keras._variables import layout_of
from tfdist.tensor import DTensor, Replicate, Shard, distribute_module
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.experimental import context_parallel

RNG = np.random.default_rng(0)


def test_distribute_module_partition_input_and_output_fns():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="a"), keras.layers.Dense(4, name="b")])
    x = RNG.standard_normal((8, 8)).astype("float32")
    want = model(x).numpy()
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    calls = []

    def partition(name, layer, m):
        if name == "a":
            return {"kernel": [Replicate(), Shard(1)], "bias": [Replicate(), Shard(0)]}

    def input_fn(module, inputs, m):
        calls.append("in")
        return inputs

    def output_fn(module, outputs, m):
        calls.append("out")
        return DTensor.from_tf(outputs) if tf.executing_eagerly() else outputs

    distribute_module(model, mesh, partition, input_fn, output_fn)
    assert layout_of(model.get_layer("a").kernel._value).sharding_specs == ["unsharded", "tp"]
    assert layout_of(model.get_layer("b").kernel._value).is_fully_replicated()
    out = model(shard_batch(tf.constant(x), mesh, 0))
    assert calls == ["in", "out"] and isinstance(out, DTensor)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5)
    with pytest.raises(ValueError, match="needs a built layer"):
        distribute_module(keras.layers.Dense(3), mesh)


@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_attention_is_exact(causal):
    keras.utils.set_random_seed(0)
    attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    x = RNG.standard_normal((4, 16, 8)).astype("float32")
    want = attn(x, x, use_causal_mask=causal).numpy()
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "cp"))
    distribute_module(attn, mesh)
    run = tf.function(lambda t: attn(t, t, use_causal_mask=causal))
    with context_parallel(mesh["cp"], buffers=[x], buffer_seq_dims=[1]) as (xs,):
        assert xs.device_mesh == mesh["cp"] and xs.placements == (Shard(1),)
        run(xs)
        with CommDebugMode() as comm:
            out = run(xs)
    np.testing.assert_allclose(gather_to_numpy(out), want, atol=1e-5)
    # each device computed the output for its own block of queries
    assert tf.experimental.dtensor.fetch_layout(out).sharding_specs[:2] == ["dp", "cp"]
    assert comm.get_total_counts() >= 1  # keys and values are gathered on the sequence
    with pytest.raises(ValueError, match="one entry per buffer"):
        with context_parallel(mesh["cp"], buffers=[x], buffer_seq_dims=[]):
            pass


def test_layouts_are_visible_on_keras_variables(capsys):
    """visualize_sharding takes a Keras weight; tfdist.keras.summary lists every variable."""
    import keras

    import tfdist
    import tfdist.keras
    from tfdist.models import MLP, mlp_tp_plan
    from tfdist.tensor.debug import visualize_sharding
    from tfdist.tensor.parallel import parallelize_module

    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    keras.utils.set_random_seed(0)
    model = MLP(8, 32)
    model(np.zeros((4, 8), np.float32))
    parallelize_module(model, mesh["tp"], mlp_tp_plan())
    table = visualize_sharding(model.up.kernel)
    assert "(R, S(1))" in table and "cpu:5" in table and "0:8    8:16" in table  # tp coordinate 1
    text = tfdist.keras.summary(model, print_fn=lambda _: None)
    up = next(line for line in text.splitlines() if line.startswith(model.up.kernel.path))
    assert "(8, 32)" in up and "dp: R, tp: S(1)" in up and up.endswith(f"{8 * 32 // 4 * 4:,}")
    assert f"total bytes per device: {(8 * 32 // 4 + 32 // 4 + 32 * 8 // 4 + 8) * 4:,}" in text
    with pytest.raises(TypeError, match="lives on one device"):
        visualize_sharding(np.ones(3))
