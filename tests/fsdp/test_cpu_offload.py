"""CPU offload (CPUOffloadPolicy, FSDP1 CPUOffload(offload_params=True)): shards on the host mesh
between steps, training equal to one device, the host mesh chosen by device type."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
from keras_helpers import DenseAdam, float64, max_weight_diff, no_global_distribution  # noqa: F401
from tfdist.fsdp import CPUOffload, CPUOffloadPolicy, FullyShardedDataParallel as FSDP, fully_shard
from tfdist.fsdp import _offload
from tfdist.keras._data import gather_to_numpy
from tfdist.tensor.debug import CommDebugMode
from test_fully_shard import IDS, NEXT, SCE, X, Y, dp_mesh, fit, make_gpt, make_mlp


def offload_mlp(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    return fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())


def meshes_of(variables):
    return {dtensor.fetch_layout(v._value.read_value()).mesh for v in variables}


def device_bytes(model, mesh):
    """Bytes of the model's parameters and optimizer state held on ``mesh``'s devices."""
    held = 0
    for v in list(model.trainable_variables) + list(model.optimizer.variables):
        value = v._value.read_value()
        if dtensor.is_dtensor(value) and dtensor.fetch_layout(value).mesh == mesh:
            held += sum(int(np.prod(s.shape)) * s.dtype.size for s in dtensor.unpack(value))
    return held


def test_mlp_fit_equals_one_device_with_state_on_the_host_mesh(float64):
    """51 samples in batches of 16: three sharded steps and a replicated last batch of 3."""
    ref = make_mlp()
    ref_loss = fit(ref, X, Y, "mse")
    model = make_mlp()
    mesh = dp_mesh()
    offload_mlp(model, mesh)
    host = _offload.host_mesh(mesh.to_tf())
    assert host != mesh.to_tf() and host.device_type() == "CPU"
    assert meshes_of(model.trainable_variables) == {host}
    loss = fit(model, X, Y, "mse")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-12
    # between steps: parameters and Adam's moments on the host mesh, each device's shard 1/8
    slots = [v for v in model.optimizer.variables if len(v.shape) > 0]
    assert len(slots) == 2 * len(model.trainable_variables)
    assert meshes_of(model.trainable_variables) == meshes_of(slots) == {host}
    assert device_bytes(model, mesh.to_tf()) == 0
    up = model.get_layer("up").kernel._value.read_value()
    assert dtensor.unpack(up)[0].shape == (2, 32)
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=16, verbose=0),
                               ref.evaluate(X, Y, batch_size=16, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(model.predict(X, batch_size=16, verbose=0), ref.predict(X, batch_size=16, verbose=0),
                               atol=1e-12)
    np.testing.assert_allclose(gather_to_numpy(model(X[:8])), ref(X[:8]).numpy(), atol=1e-12)


def test_gpt_fit_evaluate_predict_equal_one_device(float64):
    ref = make_gpt()
    ref_loss = fit(ref, IDS, NEXT, SCE)
    model = make_gpt()
    mesh = dp_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    loss = fit(model, IDS, NEXT, SCE)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11
    np.testing.assert_allclose(model.evaluate(IDS, NEXT, batch_size=16, verbose=0),
                               ref.evaluate(IDS, NEXT, batch_size=16, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(model.predict(IDS[:20], batch_size=8, verbose=0),
                               ref.predict(IDS[:20], batch_size=8, verbose=0), atol=1e-10)
    # an eager call copies the shards in for the call
    np.testing.assert_allclose(gather_to_numpy(model(IDS[:8])), ref(IDS[:8]).numpy(), atol=1e-10)


def test_offload_with_tensor_parallelism_trains_like_one_device(float64):
    """A Megatron MLP (column-parallel up, row-parallel down) on ``tp`` and offloaded FSDP on
    ``dp`` of a 2x4 mesh: shards on both dims live on the 2-D host mesh, the copies keep both."""
    from tfdist.models import MLP, mlp_tp_plan
    from tfdist.tensor.parallel import parallelize_module

    def make():
        keras.utils.set_random_seed(0)
        model = MLP(16, 32, out=3)
        model(X[:1])
        return model

    ref, model = make(), make()
    ref_loss = fit(ref, X, Y, "mse")
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], mlp_tp_plan())
    fully_shard(model, mesh=mesh["dp"], offload_policy=CPUOffloadPolicy())
    up = model.up.kernel._value.read_value()
    assert dtensor.fetch_layout(up).mesh == _offload.host_mesh(mesh.to_tf())
    assert list(dtensor.fetch_layout(up).sharding_specs) == ["dp", "tp"]
    loss = fit(model, X, Y, "mse")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-12


def test_offloaded_step_keeps_torchs_reduce_scatter(float64):
    """The device program is FSDP's: one reduce-scatter per kernel, as without offload."""
    counts = []
    for policy in (tfdist.fsdp.OffloadPolicy(), CPUOffloadPolicy()):
        model = make_mlp()
        mesh = dp_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        model.compile(optimizer=DenseAdam(1e-2), loss="mse")
        with CommDebugMode() as comm:
            model.fit(X[:32], Y[:32], batch_size=32, epochs=1, verbose=0)
        counts.append(dict(comm.get_comm_counts()))
    assert counts[0] == counts[1]
    assert sum(n for op, n in counts[1].items() if "reduce_scatter" in str(op)) >= 2


def test_fsdp1_cpu_offload_trains_like_one_device(float64):
    ref = make_gpt()
    ref_loss = fit(ref, IDS, NEXT, SCE)
    model = FSDP(make_gpt(), device_mesh=dp_mesh(), cpu_offload=CPUOffload(offload_params=True))
    host = _offload.host_mesh(dp_mesh().to_tf())
    assert meshes_of(model.trainable_variables) == {host}
    loss = fit(model, IDS, NEXT, SCE)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-11


def test_host_mesh_by_device_type():
    """CPU devices are the host: a second mesh on them under its own name. An accelerator mesh's
    host mesh is TF DTensor's own (its CPUs, one per device)."""
    cpu = dp_mesh().to_tf()
    host = _offload.host_mesh(cpu)
    assert host.local_devices() == cpu.local_devices() and host.dim_names == cpu.dim_names
    assert host.name != cpu.name and _offload.host_mesh(cpu) is host
    gpu = dtensor.Mesh(["dp"], np.arange(2), [0, 1],
                       ["/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/replica:0/task:0/device:GPU:1"])
    gpu_host = _offload.host_mesh(gpu)
    assert gpu_host.device_type() == "CPU" and gpu_host == gpu.host_mesh()
    assert list(gpu_host.dim_names) == ["dp"]


def test_refusals_name_what_is_not_built():
    model = make_mlp()
    offload_mlp(model, dp_mesh())

    @tf.function
    def own_step(x):
        return model(x)

    with pytest.raises(NotImplementedError, match="tf.function of your own"):
        own_step(tf.constant(X[:8], tf.float32))

    class Custom(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    custom = Custom([keras.Input((16,)), keras.layers.Dense(3)])
    fully_shard(custom, mesh=dp_mesh(), offload_policy=CPUOffloadPolicy())
    custom.compile(optimizer="sgd", loss="mse")
    with pytest.raises(NotImplementedError, match="overrides train_step"):
        custom.fit(X, Y, batch_size=16, verbose=0)

    mixed = make_mlp()
    fully_shard(mixed.layers[0], mesh=dp_mesh(), offload_policy=CPUOffloadPolicy())
    fully_shard(mixed, mesh=dp_mesh())
    mixed.compile(optimizer="sgd", loss="mse")
    with pytest.raises(NotImplementedError, match="offloads some trainable variables"):
        mixed.fit(X, Y, batch_size=16, verbose=0)

    hsdp = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("r", "s"))
    with pytest.raises(NotImplementedError, match="with HSDP"):
        fully_shard(make_mlp(), mesh=hsdp, offload_policy=CPUOffloadPolicy())


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_keras_hub_models_with_cpu_offload_train_like_one_device(family):
    """Third-party models: keras-hub's Llama and Gemma causal LMs, every block and the model
    offloaded, fit as on one device."""
    from test_fsdp_custom_layers import _hub_lm, assert_hub_fit_equals_one_device, hub_batch

    ref, lm = _hub_lm(family), _hub_lm(family)
    mesh = dp_mesh()
    for block in lm.backbone.transformer_layers:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(lm, mesh=mesh, offload_policy=CPUOffloadPolicy())
    assert_hub_fit_equals_one_device(ref, lm, *hub_batch())
    assert all(_offload.is_offloaded(v) for v in lm.trainable_variables)


def test_eager_call_under_a_tape_gives_one_devices_gradient(float64):
    """An eager forward under ``tf.GradientTape`` (a torch-style look at gradients): the copies
    are what the tape differentiates, and the input's gradient equals one device's."""
    ref, model = make_mlp(), make_mlp()
    offload_mlp(model, dp_mesh())
    x = tf.constant(X[:16])
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = model(x)
        loss = tf.reduce_sum(out * out)
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x)
        ref_out = ref(x)
        ref_loss = tf.reduce_sum(ref_out * ref_out)
    np.testing.assert_allclose(gather_to_numpy(loss), ref_loss.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gather_to_numpy(tape.gradient(loss, x)), ref_tape.gradient(ref_loss, x).numpy(),
                               atol=1e-10)
    # the parameters' gradients arrive on the host mesh, equal to one device's
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    with tf.GradientTape() as ref_tape:
        ref_loss = tf.reduce_sum(ref(x) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    ref_grads = ref_tape.gradient(ref_loss, ref.trainable_variables)
    host = _offload.host_mesh(dp_mesh().to_tf())
    assert {dtensor.fetch_layout(g).mesh for g in grads} == {host}
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(gather_to_numpy(g), r.numpy(), atol=1e-10)


def test_distributed_checkpoint_of_an_offloaded_model_loads_anywhere(float64, tmp_path):
    """The host-mesh shards save with DCP; an FSDP model without offload loads them, and an
    offloaded one loads a plain model's checkpoint (values checked against the trained weights)."""
    import tfdist.checkpoint as dcp
    from tfdist.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

    model = make_mlp()
    offload_mlp(model, dp_mesh())
    fit(model, X, Y, "mse", epochs=1)
    model_sd, optim_sd = get_state_dict(model, model.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "offloaded"))

    plain = make_mlp()
    fully_shard(plain, mesh=dp_mesh())
    fit(plain, X[:16], Y[:16], "mse", epochs=1)  # builds Adam's slots
    state = dict(zip(("model", "optim"), get_state_dict(plain, plain.optimizer)))
    dcp.load(state, checkpoint_id=str(tmp_path / "offloaded"))
    set_state_dict(plain, plain.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.optimizer.variables[2].numpy(), model.optimizer.variables[2].numpy())

    again = make_mlp()
    offload_mlp(again, dp_mesh())
    state = {"model": get_model_state_dict(again)}
    dcp.load(state, checkpoint_id=str(tmp_path / "offloaded"))
    set_model_state_dict(again, state["model"])
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert meshes_of(again.trainable_variables) == {_offload.host_mesh(dp_mesh().to_tf())}
