"""Keras 3 model.fit/evaluate/predict on DTensor through keras.distribution."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist.keras  # noqa: F401  (installs the TF backend of keras.distribution)
from keras_helpers import DenseAdam, make_mlp, max_weight_diff, model_parallel, no_global_distribution  # noqa: F401
from tfdist.keras import _variables

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 16)).astype("float32")
Y = RNG.standard_normal((64, 8)).astype("float32")


def compile_(model, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], **kwargs)
    return model


def reference(epochs=2, **fit_kwargs):
    keras.distribution.set_distribution(None)
    model = compile_(make_mlp())
    history = model.fit(X, Y, batch_size=16, epochs=epochs, verbose=0, shuffle=False, **fit_kwargs)
    return model, history


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (8, 1), (1, 8)], ids=str)
def test_model_parallel_fit_equals_one_device(mesh_shape):
    ref, ref_hist = reference()
    keras.distribution.set_distribution(model_parallel(mesh_shape))
    model = compile_(make_mlp())
    assert isinstance(model.layers[0].kernel._value, tf.experimental.dtensor.DVariable)
    hist = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist.history["mae"], ref_hist.history["mae"], rtol=1e-5)
    assert max_weight_diff(ref, model) < 1e-5
    np.testing.assert_allclose(model.evaluate(X, Y, verbose=0), ref.evaluate(X, Y, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(X, verbose=0, batch_size=16), ref.predict(X, verbose=0), atol=1e-5)


def test_layouts_of_weights_slots_and_metrics():
    keras.distribution.set_distribution(model_parallel())
    model = compile_(make_mlp())
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    layout = _variables.layout_of
    up = model.get_layer("up")
    assert layout(up.kernel._value).sharding_specs == ["unsharded", "model"]
    assert layout(up.bias._value).sharding_specs == ["model"]
    assert layout(model.get_layer("down").kernel._value).sharding_specs == ["model", "unsharded"]
    slots = {v.path: v for v in model.optimizer.variables}
    moments = [v for p, v in slots.items() if "up_kernel" in p]
    assert moments and all(layout(v._value).sharding_specs == ["unsharded", "model"] for v in moments)
    for metric_var in model.metrics_variables:
        assert layout(metric_var._value).is_fully_replicated()


def test_data_parallel_with_datasets_generators_and_validation():
    ref, ref_hist = reference(validation_data=(X[:32], Y[:32]))
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = compile_(make_mlp())
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    hist = model.fit(data, epochs=2, verbose=0, validation_data=(X[:32], Y[:32]))
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist.history["val_loss"], ref_hist.history["val_loss"], rtol=1e-5)
    assert max_weight_diff(ref, model) < 1e-5

    def batches():
        for i in range(0, 64, 16):
            yield X[i:i + 16], Y[i:i + 16]

    seen = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(logs["loss"]))
    model.fit(batches(), epochs=1, steps_per_epoch=4, verbose=0, callbacks=[counter])
    assert len(seen) == 4 and all(np.isfinite(seen))


def test_sample_weight_and_class_weight():
    w = np.linspace(0.5, 1.5, 64).astype("float32")
    ref, ref_hist = reference(sample_weight=w)
    keras.distribution.set_distribution(model_parallel())
    model = compile_(make_mlp())
    hist = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False, sample_weight=w)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)

    labels = (X[:, 0] > 0).astype("int32")

    def classifier():
        keras.utils.set_random_seed(1)
        m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(2, name="head")])
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    keras.distribution.set_distribution(None)
    plain = classifier()
    want = plain.fit(X, labels, batch_size=16, epochs=1, verbose=0, shuffle=False, class_weight={0: 1.0, 1: 3.0})
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    dist = classifier()
    got = dist.fit(X, labels, batch_size=16, epochs=1, verbose=0, shuffle=False, class_weight={0: 1.0, 1: 3.0})
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)


def test_embedding_trains_sharded_and_replicated():
    ids = RNG.integers(0, 16, (32, 6))
    target = RNG.standard_normal((32, 6, 8)).astype("float32")

    def embedder():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(16, 8, name="emb")])
        m.compile(optimizer=DenseAdam(0.05), loss="mse")
        return m

    ref = embedder()
    ref.fit(ids, target, batch_size=8, epochs=2, verbose=0, shuffle=False)
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*emb/embeddings"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = embedder()
    model.fit(ids, target, batch_size=8, epochs=2, verbose=0, shuffle=False)
    assert max_weight_diff(ref, model) < 1e-5


def test_save_and_load_weights_across_meshes(tmp_path):
    keras.distribution.set_distribution(model_parallel((2, 4)))
    model = compile_(make_mlp())
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "mlp.weights.h5")
    model.save_weights(path)
    want = model.get_weights()
    keras.distribution.set_distribution(None)
    single = make_mlp()
    single.load_weights(path)
    for a, b in zip(single.get_weights(), want):
        np.testing.assert_array_equal(a, b)
    keras.distribution.set_distribution(model_parallel((4, 2)))
    other = make_mlp()
    other.load_weights(path)
    for a, b in zip(other.get_weights(), want):
        np.testing.assert_array_equal(a, b)
    assert _variables.is_dtensor_variable(other.get_layer("up").kernel)


def test_indivisible_batch_trains_like_one_device():
    """A batch of 5 on a 2-way data-parallel mesh is computed whole by both replicas."""
    ref = compile_(make_mlp())
    ref.fit(X[:5], Y[:5], batch_size=5, epochs=1, verbose=0)
    keras.distribution.set_distribution(model_parallel())
    model = compile_(make_mlp())
    model.fit(X[:5], Y[:5], batch_size=5, epochs=1, verbose=0)
    assert max_weight_diff(ref, model) < 1e-5


def test_layout_map_key_matching_nothing_is_a_warning_and_strict_makes_it_an_error():
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map["up/kernel"] = (None, "model")  # misses the model-name prefix: Keras ignores it
    layout_map[".*down/output"] = ("batch", None)  # a layer output: matches, no warning for it
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model = compile_(make_mlp())
    with pytest.warns(UserWarning, match=r"LayoutMap keys \['up/kernel'\] match no variable"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(model.evaluate(X, Y, verbose=0)).all()

    strict = tfdist.keras.LayoutMap(mesh, strict=True)
    strict["up/kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=strict))
    model = compile_(make_mlp())
    with pytest.raises(ValueError, match=r"LayoutMap keys \['up/kernel'\] match no variable.*strict=True"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="strict must be a bool. Received: strict='yes'"):
        tfdist.keras.LayoutMap(mesh, strict="yes")


def _uneven_model():
    keras.utils.set_random_seed(0)
    return compile_(keras.Sequential([keras.Input((16,)), keras.layers.Dense(6, name="odd"),
                                      keras.layers.Dense(8, name="down")]))


def _uneven_distribution(mesh_shape=(2, 4)):
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*odd/kernel"] = (None, "model")  # 6 columns over 4 devices: uneven (JAX pads)
    layout_map[".*odd/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)  # 6 rows over 4 devices
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_uneven_variable_dim_is_stored_padded_and_trains_like_one_device(tmp_path):
    ref = _uneven_model()
    ref.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    keras.distribution.set_distribution(_uneven_distribution())
    model = _uneven_model()
    kernel = model.get_layer("odd").kernel
    # stored as torch.chunk splits 6 over 4 (2, 2, 2, 0) padded to 8: two columns per device
    assert tuple(kernel._value.shape) == (16, 8) and tuple(kernel.shape) == (16, 6)
    assert _variables.layout_of(kernel._value).sharding_specs == [dtensor.UNSHARDED, "model"]
    assert [tuple(t.shape) for t in dtensor.unpack(kernel._value.read_value())] == [(16, 2)] * 8
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert max_weight_diff(ref, model) < 1e-5
    assert [w.shape for w in model.get_weights()] == [w.shape for w in ref.get_weights()]
    np.testing.assert_allclose(model.predict(X, verbose=0, batch_size=16), ref.predict(X, verbose=0), atol=1e-5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(X[:16])), ref(X[:16]), atol=1e-5)
    # the padding stays zero: in the weights and in Adam's moments (a padded slot of a padded weight)
    stored = dtensor.relayout(kernel._value.read_value(), dtensor.Layout.replicated(kernel._value.layout.mesh, 2))
    np.testing.assert_array_equal(dtensor.unpack(stored)[0].numpy()[:, 6:], 0)
    moments = [v for v in model.optimizer.variables if "odd_kernel" in v.path]
    assert moments and all(tuple(v._value.shape) == (16, 8) and tuple(v.shape) == (16, 6) for v in moments)
    # weights files and assign take and give Keras' shape
    model.save_weights(str(tmp_path / "w.weights.h5"))
    keras.distribution.set_distribution(None)
    one = _uneven_model()
    one.load_weights(str(tmp_path / "w.weights.h5"))
    assert max_weight_diff(ref, one) < 1e-5
    keras.distribution.set_distribution(_uneven_distribution((4, 2)))  # 6 over 2: even; rows 6 over 2
    back = _uneven_model()
    back.load_weights(str(tmp_path / "w.weights.h5"))
    assert max_weight_diff(ref, back) < 1e-5
    kernel.assign(np.ones((16, 6), "float32"))
    np.testing.assert_array_equal(kernel.numpy(), 1)


def test_uneven_variable_resumes_from_a_distributed_checkpoint_on_another_mesh(tmp_path):
    ref = _uneven_model()
    ref.fit(X, Y, batch_size=16, epochs=4, verbose=0, shuffle=False)
    keras.distribution.set_distribution(_uneven_distribution())
    model = _uneven_model()
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=[tfdist.keras.DistributedCheckpoint(str(tmp_path))])
    keras.distribution.set_distribution(_uneven_distribution((1, 8)))  # 6 over 8: padded to 8 rows/columns
    resumed = _uneven_model()
    resumed.fit(X, Y, batch_size=16, epochs=4, verbose=0, shuffle=False,
                callbacks=[tfdist.keras.DistributedCheckpoint(str(tmp_path))])
    assert tuple(resumed.get_layer("odd").kernel._value.shape) == (16, 8)
    assert max_weight_diff(ref, resumed) < 1e-5


def test_tfdist_layout_map_takes_styles_placements_and_axes():
    from tfdist.tensor import Replicate, Shard
    from tfdist.tensor.parallel import ColwiseParallel

    ref, ref_hist = reference()
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = tfdist.keras.LayoutMap(mesh)
    layout_map[".*up/.*"] = ColwiseParallel()                     # kernel S(1), bias S(0)
    layout_map[".*down/kernel"] = (Replicate(), Shard(0))         # placements per mesh dim
    layout_map[".*down/bias"] = (None,)                           # Keras axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = compile_(make_mlp())
    layout = _variables.layout_of
    assert layout(model.get_layer("up").kernel._value).sharding_specs == ["unsharded", "model"]
    assert layout(model.get_layer("up").bias._value).sharding_specs == ["model"]
    assert layout(model.get_layer("down").kernel._value).sharding_specs == ["model", "unsharded"]
    hist = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    with pytest.raises(ValueError, match="placements has 1 entries but the mesh has 2 dims"):
        layout_map[".*x"] = (Shard(0),)


def test_distribution_set_after_the_model_was_built_is_a_clear_error():
    model = compile_(make_mlp())  # variables made with no distribution
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    with pytest.raises(ValueError, match="came after .* created its variables"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)


@pytest.mark.parametrize("key,axes", [(".*up/kernel", (None, "model", None)), (".*", (None, "model"))],
                         ids=["rank-3 layout", "'.*' also matches biases"])
def test_layout_map_value_of_the_wrong_rank_names_the_variable(key, axes):
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[key] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    with pytest.raises(ValueError, match=r"for variable '.*up/(kernel|bias)' has \d axes, but the variable has shape"):
        make_mlp()


@pytest.mark.parametrize("steps", [3, 4])
def test_steps_per_execution_gives_one_devices_losses(steps):
    """steps_per_execution > 1 on the DTensor path: the epoch losses and weights of one device running one
    step per call (4 batches per epoch; 3 leaves a remainder call of 1 step)."""
    ref, ref_hist = reference(epochs=3)
    keras.distribution.set_distribution(model_parallel((2, 4)))
    model = compile_(make_mlp(), steps_per_execution=steps)
    hist = model.fit(X, Y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    assert model.optimizer.iterations.numpy() == 12
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    assert max_weight_diff(ref, model) < 1e-5


def test_why_steps_per_execution_runs_one_program_per_step():
    """Fusing the steps of an execution into one program would save one DTensor dispatch per step
    (1-2 ms on W1), but TF DTensor (its defaults) then serves the second step a metric value from
    before the first step's write (docs/tf_dtensor_repros/stale_read_across_calls.py, run as a
    script). Its all-reduce combine pass is the cause: with it off, or with its groups limited to
    one all-reduce (tfdist's setting outside Keras' train and test steps), both calls are right."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "docs" / "tf_dtensor_repros" / "stale_read_across_calls.py"
    combine_settings = ("DTENSOR_ENABLE_COMBINE", "DTENSOR_ALLREDUCE_COMBINE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(combine_settings)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]  # TF's defaults
    assert "two calls from Python: total=992.0 count=2.0" in out.stdout
    assert "REPRODUCED" in out.stdout
    # the cause: TF DTensor's all-reduce combine pass -- off, or on with groups of one all-reduce
    # (what tfdist sets for every program but Keras' train and test steps, docs/design.md)
    for setting in ({"DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION": "0"},
                    {"DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION": "1",
                     "DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE": "1"}):
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env={**env, **setting})
        assert out.returncode == 0 and "two calls in one tf.function: total=992.0 count=2.0" in out.stdout, (
            setting, out.stdout)


def test_steps_per_epoch_over_a_repeated_dataset_continues_the_stream_across_epochs():
    """Keras keeps one iterator across epochs when steps_per_epoch is set; the feed must too,
    or batches would be skipped or replayed (reference: the same fit on one device)."""
    def data():  # 6 distinct batches; 3 epochs of 2 steps walk through them once
        return tf.data.Dataset.from_tensor_slices((X[:48], Y[:48])).batch(8).repeat()

    keras.distribution.set_distribution(None)
    ref = compile_(make_mlp())
    ref_hist = ref.fit(data(), steps_per_epoch=2, epochs=3, verbose=0)
    keras.distribution.set_distribution(model_parallel())
    model = compile_(make_mlp())
    hist = model.fit(data(), steps_per_epoch=2, epochs=3, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    assert max_weight_diff(ref, model) < 1e-5


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_processes=0), r"num_processes must be a positive int. Received: num_processes=0"),
    (dict(num_processes=2, process_id=2), r"process_id must be an int in \[0, 2\) for 2 processes. Received: process_id=2"),
    (dict(job_addresses="10.0.0.1:1234", num_processes=2, process_id=0),
     r"job_addresses must list one host:port per process \(2\), process 0 first"),
])
def test_keras_distribution_initialize_names_the_bad_argument(kwargs, match, monkeypatch):
    for key in ("DTENSOR_NUM_CLIENTS", "DTENSOR_CLIENT_ID", "DTENSOR_JOBS"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match=match):
        keras.distribution.initialize(**kwargs)
    assert "DTENSOR_NUM_CLIENTS" not in os.environ  # nothing half-set
    assert keras.distribution.list_devices("cpu") == [f"cpu:{i}" for i in range(8)]


@pytest.mark.parametrize("compiled_in_scope", [False, True], ids=["compiled-outside", "compiled-inside"])
def test_a_model_built_in_a_distribution_scope_trains_outside_it_like_one_device(compiled_in_scope):
    """keras-hub's documented usage: build under ``distribution.scope()``, compile and fit after it.
    The model keeps the distribution its variables were laid out by (batches split over
    ``batch``, optimizer and metrics made under it): SGD losses and weights as one device's."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 8)).astype("float32"), rng.standard_normal((32, 4)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="d1"), keras.layers.Dense(4, name="d2")])

    def fit(model):
        if not model.compiled:
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False).history["loss"]

    reference = build()
    ref_losses = fit(reference)
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        model = build()
        if compiled_in_scope:
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert keras.distribution.distribution() is None
    np.testing.assert_allclose(fit(model), ref_losses, rtol=1e-5)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), atol=1e-5)


@pytest.mark.parametrize("kernel_axes", [(None, None, None, "model"), (None, None, "model", None)])
def test_a_conv_with_a_channel_sharded_kernel_runs_eagerly_predicts_and_trains_as_one_device(kernel_axes):
    """TF DTensor's conv expander refuses a sharded filter ("Filter for convolution must have
    fully replicated layout"), op by op as well as traced: the eager call runs traced and
    legalized (keras/_eager_calls.py, tensor/_legalize.py); fit with SGD equals one device."""
    x = np.random.default_rng(5).standard_normal((8, 6, 6, 4)).astype("float32")
    y = np.random.default_rng(6).standard_normal((8, 4, 4, 8)).astype("float32")

    def make():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((6, 6, 4)), keras.layers.Conv2D(8, 3, name="conv")])

    one = make()
    start, eager, predicted = one.get_weights(), one(x).numpy(), one.predict(x, verbose=0)
    one.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    losses = one.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*conv/kernel"] = kernel_axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = make()
    model.set_weights(start)
    held = dtensor.fetch_layout(model.layers[0].kernel.value).sharding_specs
    assert tuple(held) == tuple(a or dtensor.UNSHARDED for a in kernel_axes)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x)), eager, atol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0), predicted, atol=1e-5)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    got = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    for a, b in zip(one.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5)
