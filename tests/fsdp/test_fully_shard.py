"""fully_shard on Keras models: parity with one device, sharded state, collectives, policies, errors."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import (  # noqa: F401
    DenseAdam, float64, logits_loss_grads, max_weight_diff, no_global_distribution, sum_sq_grads, traced_sum_sq_grads,
)
from tfdist.fsdp import (
    CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method,
)
from tfdist.keras._data import gather_to_numpy
from tfdist.models import GPT, gpt_tp_plan
from tfdist.tensor import Shard
from tfdist.tensor.debug import CommDebugMode
from tfdist.tensor.parallel import parallelize_module

RNG = np.random.default_rng(0)
X = RNG.standard_normal((51, 16))
Y = RNG.standard_normal((51, 3))
V, S = 32, 8
IDS = RNG.integers(0, V, (64, S))
NEXT = RNG.integers(0, V, (64, S))
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dp_mesh(n=8):
    return tfdist.init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))


def make_mlp():
    """16 -> 32 (relu) -> LayerNorm -> 3: the last bias (3) is smaller than the mesh (8)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(3, name="down"),
    ])


def make_gpt():
    keras.utils.set_random_seed(0)
    model = GPT(V, S, dim=16, heads=4, depth=2)
    model(IDS[:1])
    return model


def shard_gpt(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fit(model, x, y, loss, epochs=2, batch=16):
    model.compile(optimizer=DenseAdam(1e-2), loss=loss)
    return model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False).history["loss"]


def local_shape(variable):
    from tensorflow.experimental import dtensor

    return tuple(dtensor.unpack(variable._value.read_value())[0].shape)


def test_mlp_fit_equals_one_device(float64):
    """51 samples in batches of 16: three sharded steps and a last batch of 3 (replicated)."""
    ref = make_mlp()
    ref_loss = fit(ref, X, Y, "mse")
    model = make_mlp()
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh())
    fully_shard(model, mesh=dp_mesh())
    loss = fit(model, X, Y, "mse")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)  # Keras reports the loss in float32
    assert max_weight_diff(ref, model) < 1e-12


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["fsdp-8", "fsdp2xtp4"])
def test_gpt_fit_equals_one_device(float64, shape):
    ref = make_gpt()
    ref_loss = fit(ref, IDS, NEXT, SCE)
    model = make_gpt()
    if len(shape) == 1:
        mesh = dp_mesh()
        shard_gpt(model, mesh)
    else:
        mesh = tfdist.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        # gathered logits: TF's cross-entropy kernel on both sides, so the 1e-11 bound tests FSDP
        # alone (the default, loss_parallel, is tested against one device in test_keras_loss_parallel)
        parallelize_module(model, mesh["tp"], gpt_tp_plan(loss_parallel=False))
        shard_gpt(model, mesh["dp"])
    loss = fit(model, IDS, NEXT, SCE)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)  # Keras reports the loss in float32
    assert max_weight_diff(ref, model) < 1e-11


def test_fsdp_on_tp_shards_weights_on_both_mesh_dims():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = make_gpt()
    parallelize_module(model, mesh["tp"], gpt_tp_plan())
    shard_gpt(model, mesh["dp"])
    up = model.blocks[0].mlp.up.kernel  # Colwise: [16, 64] tp on dim 1; FSDP adds dp on dim 0
    assert local_shape(up) == (8, 16)
    down = model.blocks[0].mlp.down.kernel  # Rowwise: [64, 16] tp on dim 0; FSDP takes dim 1
    assert local_shape(down) == (16, 8)


def test_parameters_gradients_and_optimizer_state_are_sharded():
    model = make_gpt()
    shard_gpt(model, dp_mesh())
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=SCE)
    model.fit(IDS[:16], NEXT[:16], batch_size=16, epochs=1, verbose=0)
    whole = 0
    for v in model.trainable_variables:
        n, k = int(np.prod(v.shape)), int(np.prod(local_shape(v)))
        if any(d % 8 == 0 for d in v.shape):
            assert k * 8 == n, v.path
        else:  # the attention biases (4 heads x 4) have no dim of 8 or more: kept whole
            assert k == n and max(v.shape) < 8, v.path
            whole += n
    assert whole < 0.02 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    slots = [v for v in model.optimizer.variables if len(v.shape) and hasattr(v._value, "layout")]
    for slot in slots:
        assert int(np.prod(local_shape(slot))) * 8 == int(np.prod(slot.shape)) or slot.shape[0] % 8, slot.path
    assert any(int(np.prod(local_shape(s))) * 8 == int(np.prod(s.shape)) for s in slots)
    grads = logits_loss_grads(model, IDS[:16], NEXT[:16])[2]
    kernel = model.blocks[0].mlp.up.kernel
    g = grads[[id(v) for v in model.trainable_variables].index(id(kernel))]
    from tensorflow.experimental import dtensor

    assert dtensor.fetch_layout(g).sharding_specs[0] == "dp"  # the gradient arrives as the shard


def dense_stack(depth=4, dim=64):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((dim,))] + [keras.layers.Dense(dim, activation="tanh", name=f"d{i}") for i in range(depth)]
    )


@pytest.mark.parametrize("reshard", [True, False])
def test_collectives_are_gathers_and_reduce_scatters(reshard):
    """4 Dense layers: forward 4 gathers (x2 params); backward gathers again the 3 kernels whose input
    gradient is needed (reshard=True); every gradient is reduce-scattered; no all-reduce."""
    model = dense_stack()
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh(), reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh(), reshard_after_forward=reshard)
    x = tf.constant(RNG.standard_normal((16, 64)), tf.float32)
    grads, comm = traced_sum_sq_grads(model, x)
    counts = comm.get_comm_counts()
    assert counts.get("all_gather_into_tensor") == 8 + (3 if reshard else 0)
    assert counts.get("reduce_scatter_tensor") == 8
    assert "all_reduce" not in counts
    for a, b in zip(sum_sq_grads(dense_stack(), x), grads):
        np.testing.assert_allclose(gather_to_numpy(b), a.numpy(), rtol=2e-5, atol=2e-6)


def test_custom_tf_function_loop_equals_one_device(float64):
    ref = make_gpt()
    model = shard_gpt(make_gpt(), dp_mesh())
    ids, labels = tf.constant(IDS[:16]), tf.constant(NEXT[:16])
    _, ref_loss, ref_grads = logits_loss_grads(ref, ids, labels)
    step = tf.function(lambda i, l: logits_loss_grads(model, i, l))
    _, loss, grads = step(ids, labels)
    assert abs(float(gather_to_numpy(loss)) - float(ref_loss)) < 1e-12
    for a, b in zip(ref_grads, grads):
        np.testing.assert_allclose(gather_to_numpy(tf.convert_to_tensor(b)), tf.convert_to_tensor(a).numpy(),
                                   atol=1e-12)


def test_mixed_precision_bfloat16_params_float32_reduction():
    """bf16 gathers and products, f32 master weights and gradient reduction: within bf16's precision
    of the float32 computation; the optimizer state stays float32."""
    ref = dense_stack(depth=2)
    model = dense_stack(depth=2)
    policy = MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32", output_dtype="float32")
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh(), mp_policy=policy)
    fully_shard(model, mesh=dp_mesh(), mp_policy=policy)
    x = tf.constant(RNG.standard_normal((16, 64)), tf.float32)
    with tf.GradientTape() as tape:
        y = model(x)
        loss = tf.reduce_mean(y * y)
    grads = tape.gradient(loss, model.trainable_variables)
    assert y.dtype == tf.float32
    with tf.GradientTape() as tape:
        y_ref = ref(x)
        ref_loss = tf.reduce_mean(y_ref * y_ref)
    ref_grads = tape.gradient(ref_loss, ref.trainable_variables)
    np.testing.assert_allclose(gather_to_numpy(y), y_ref.numpy(), atol=3e-2)
    for v, a, b in zip(model.trainable_variables, ref_grads, grads):
        assert v.dtype == "float32" and b.dtype == tf.float32
        scale = float(np.abs(a.numpy()).max())
        assert float(np.abs(gather_to_numpy(b) - a.numpy()).max()) < 3e-2 * scale, v.path


def test_class_is_fsdp_module_and_noops_are_silent():
    model = dense_stack(depth=1)
    fully_shard(model.layers[0], mesh=dp_mesh())
    fully_shard(model, mesh=dp_mesh())
    assert isinstance(model, FSDPModule) and isinstance(model, keras.Sequential)
    assert type(model.layers[0]).__name__ == "FSDPDense"
    assert {id(v) for v in model.layers[0].fsdp_params} == {id(model.layers[0].kernel), id(model.layers[0].bias)}
    assert model.fsdp_params == []  # all grouped by the child
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.unshard(async_op=True).wait()
        model.reshard()
        model.set_reshard_after_backward(False)
        model.set_is_last_backward(True)
        model.set_requires_all_reduce(False)


def test_register_fsdp_forward_method(float64):
    ref = make_mlp()
    model = make_mlp()
    fully_shard(model, mesh=dp_mesh())
    model.logits_of = lambda x: model.layers[-1](model.layers[1](model.layers[0](x)))
    register_fsdp_forward_method(model, "logits_of")
    x = tf.constant(X[:8])
    np.testing.assert_allclose(gather_to_numpy(model.logits_of(x)), ref(x).numpy(), atol=1e-12)


@pytest.mark.parametrize("wrap", ["root", "per-layer", "per-layer-hsdp"])
def test_save_weights_load_into_one_device_model(tmp_path, float64, wrap):
    """The file holds full values a plain model loads.  Keras files a Sequential's layers by class
    name; tfdist's FSDPDense is filed as Dense, so torch-style per-layer wrapping (FSDP or HSDP)
    saves the same file."""
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("r", "s")) if wrap.endswith("hsdp") else dp_mesh()

    def wrapped():
        model = make_mlp()
        for layer in model.layers if wrap != "root" else []:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = wrapped()
    fit(model, X, Y, "mse", epochs=1)
    path = str(tmp_path / "fsdp.weights.h5")
    model.save_weights(path)
    plain = make_mlp()
    plain.load_weights(path)
    assert max_weight_diff(model, plain) == 0.0
    again = wrapped()
    again.load_weights(path)
    assert max_weight_diff(again, plain) == 0.0
    if wrap != "root":
        assert type(model.layers[0]).__name__ == "FSDPDense"  # torch's class names stay


def test_ignored_params_and_shard_placement_fn():
    model = dense_stack(depth=2, dim=16)
    first = model.layers[0]
    fully_shard(model, mesh=dp_mesh(), ignored_params=[first.bias],  # Keras variables are unhashable: a list
                shard_placement_fn=lambda v: Shard(1) if len(v.shape) == 2 else None)
    assert local_shape(first.kernel) == (16, 2)
    assert not hasattr(first.bias._value, "layout") or local_shape(first.bias) == (16,)
    assert all(id(v) != id(first.bias) for v in model.fsdp_params)


def test_bad_input_is_refused_before_anything_changes():
    model = dense_stack(depth=1)
    with pytest.raises(ValueError, match="1-D .FSDP. or 2-D"):
        fully_shard(model, mesh=tfdist.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("r", "s", "tp")))
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype="int32")
    with pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(model, mesh=dp_mesh(), reshard_after_forward="yes")
    with pytest.raises(ValueError, match="offload_policy"):
        fully_shard(model, mesh=dp_mesh(), offload_policy="cpu")
    with pytest.raises(ValueError, match="Shard"):
        fully_shard(model, mesh=dp_mesh(), shard_placement_fn=lambda v: "dim0")
    with pytest.raises(ValueError, match="not built"):
        fully_shard(keras.layers.Dense(4), mesh=dp_mesh())
    assert not isinstance(model, FSDPModule)
    assert all(not hasattr(v._value, "layout") for v in model.variables)  # nothing was placed
    fully_shard(model, mesh=dp_mesh())
    with pytest.raises(ValueError, match="already applied"):
        fully_shard(model, mesh=dp_mesh())


def test_docs_example_runs_as_written():
    """docs/fsdp.md's first example, verbatim (8 virtual CPUs are already set up)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "fsdp.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(code, "docs/fsdp.md", "exec"), namespace)
    model = namespace["model"]
    assert isinstance(model, FSDPModule) and model.optimizer.iterations.numpy() == 4


def test_gradient_accumulation_equals_one_large_batch(float64):
    """Keras' gradient_accumulation_steps on an FSDP model (the accumulators are sharded like their
    variables): two batches of 16 then one update == one batch of 32 on one device."""
    ref = make_mlp()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(X[:32], Y[:32], batch_size=32, epochs=1, verbose=0, shuffle=False)
    model = make_mlp()
    fully_shard(model, mesh=dp_mesh())
    model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
    model.fit(X[:32], Y[:32], batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert max_weight_diff(ref, model) < 1e-12


def test_cross_mesh_copy_limitation_reproduces():
    """Why CPU offload copies shards between programs, run as a script: inside one, a sharded
    DTensor cannot cross meshes."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "docs" / "tf_dtensor_repros" / "cross_mesh_sharded_copy.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert "replicated copy to the host mesh" in out.stdout and "sharded copy to the host mesh fails" in out.stdout


def test_hsdp_limitation_reproduces():
    """The two TF refusals HSDP goes around (a batch over two mesh dims; no vectorised Relayout
    in TF itself), run as a script."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "docs" / "tf_dtensor_repros" / "hsdp_batch_two_mesh_dims.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert out.stdout.count("refused") == 3 and "converter for Relayout: True" in out.stdout


def test_parted_layouts_hold_per_device_values():
    """The route found for local SGD and HSDP's replicas (issue notes, docs/design.md): TF DTensor's
    parted layouts keep per-device values, local gradients, and average them with one all-reduce."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "docs" / "tf_dtensor_repros" / "parted_layout_per_device_values.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.count(": yes") == 3


def test_embedding_gradient_is_reduce_scattered():
    """Embedding -> Dense: the table's gradient is each device's one-hot product, reduce-scattered
    (an all-to-all), not TF's all-reduce of the whole table; values equal one device."""
    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((S,), dtype="int32"), keras.layers.Embedding(V, 16),
                                 keras.layers.Dense(8)])

    model = make()
    fully_shard(model, mesh=dp_mesh())
    ids = tf.constant(IDS[:16])
    got, comm = traced_sum_sq_grads(model, ids)
    counts = comm.get_comm_counts()
    assert "all_reduce" not in counts and counts.get("reduce_scatter_tensor") == 3, counts
    for a, b in zip(sum_sq_grads(make(), ids), got):
        np.testing.assert_allclose(gather_to_numpy(b), tf.convert_to_tensor(a).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_tp", [False, True], ids=["fsdp", "fsdp+tp"])
def test_layout_map_fsdp_style_trains_like_one_device(float64, with_tp):
    """FSDPStyle as a tfdist.keras.LayoutMap value under keras.distribution.ModelParallel."""
    import tfdist.keras as tk
    from tfdist.fsdp import FSDPStyle
    from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel

    ref = make_mlp()
    ref_loss = fit(ref, X[:48], Y[:48], "mse")
    mesh = keras.distribution.DeviceMesh((2, 4) if with_tp else (8, 1), ["batch", "model"])
    layout_map = tk.LayoutMap(mesh)
    layout_map[".*up/.*"] = FSDPStyle(tp_style=ColwiseParallel() if with_tp else None)
    layout_map[".*down/.*"] = FSDPStyle(tp_style=RowwiseParallel() if with_tp else None)
    layout_map[".*norm/.*"] = FSDPStyle()
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    model = make_mlp()
    up = model.get_layer("up").kernel
    assert local_shape(up) == ((8, 8) if with_tp else (2, 32))  # (dp on in, tp on out) / dp on in
    loss = fit(model, X[:48], Y[:48], "mse")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-12
    counts = traced_sum_sq_grads(model, tf.constant(X[:16]))[1].get_comm_counts()
    # gathers before use, reduce-scatters (all-to-all) of the sharded gradients; with tp the
    # row-parallel product's all-reduce over tp is the tensor-parallel one
    assert counts.get("all_gather_into_tensor", 0) >= 4 and counts.get("reduce_scatter_tensor", 0) >= 3, counts
    if not with_tp:
        assert counts.get("all_reduce", 0) <= 1, counts  # the 3-element bias, kept whole


def test_all_reduce_hook_transforms_every_reduced_gradient_shard(float64):
    """A hook halving the gradients: the GPT (dense, einsum, norm, embedding and whole-kept
    parameters) trains with SGD(lr) as one device trains with SGD(lr / 2); the hook sees each
    gradient as its dp shard, once per parameter per step."""
    ref = make_gpt()
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss=SCE)
    ref_loss = ref.fit(IDS[:32], NEXT[:32], batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    model = shard_gpt(make_gpt(), dp_mesh())
    seen = []

    def halve(grad):
        seen.append(grad.shape)
        return grad * 0.5

    for block in model.blocks:
        block.set_all_reduce_hook(halve)
    model.set_all_reduce_hook(halve)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCE)
    loss = model.fit(IDS[:32], NEXT[:32], batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)  # Keras' loss tracker is float32
    assert max_weight_diff(ref, model) < 1e-11
    assert len(seen) == len(model.trainable_variables)  # traced once: one call per parameter
    with pytest.raises(ValueError, match="hook"):
        model.set_all_reduce_hook("not callable")


def test_all_reduce_hook_returning_none_keeps_the_gradient_and_a_bad_shape_is_named(float64):
    ref = make_mlp()
    ref_loss = fit(ref, X[:32], Y[:32], "mse", epochs=1)
    model = fully_shard(make_mlp(), mesh=dp_mesh())
    model.set_all_reduce_hook(lambda grad: None)
    np.testing.assert_allclose(fit(model, X[:32], Y[:32], "mse", epochs=1), ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    bad = fully_shard(make_mlp(), mesh=dp_mesh())
    bad.set_all_reduce_hook(lambda grad: tf.reduce_sum(grad))
    with pytest.raises(ValueError, match="shape"):
        fit(bad, X[:32], Y[:32], "mse", epochs=1)
