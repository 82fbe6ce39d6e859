"""tfdist.optim.ZeroRedundancyOptimizer: sharded optimizer state, same training as plain Adam."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
import tfdist.keras  # noqa: F401 - keras.distribution on TensorFlow
from keras_helpers import float64, make_mlp, max_weight_diff, no_global_distribution  # noqa: F401
from tfdist.optim import ZeroRedundancyOptimizer
from tfdist.tensor.debug import CommDebugMode

RNG = np.random.default_rng(3)
X = RNG.standard_normal((64, 16))
Y = RNG.standard_normal((64, 8))


def data_parallel():
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=[f"cpu:{i}" for i in range(8)]))


def local_numel(variable):
    return int(np.prod(dtensor.unpack(variable._value.read_value())[0].shape))


@pytest.mark.parametrize("optimizer_class", [keras.optimizers.Adam, keras.optimizers.SGD, keras.optimizers.AdamW])
def test_trains_like_the_plain_optimizer_with_state_sharded(float64, optimizer_class):
    kwargs = {"learning_rate": 1e-2} if optimizer_class is not keras.optimizers.SGD else {"learning_rate": 0.1,
                                                                                           "momentum": 0.9}
    ref = make_mlp()
    ref.compile(optimizer=optimizer_class(**kwargs), loss="mse")
    ref_hist = ref.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    data_parallel()
    model = make_mlp()
    opt = ZeroRedundancyOptimizer(model.trainable_variables, optimizer_class, **kwargs)
    assert isinstance(opt, optimizer_class) and type(opt).__name__ == f"ZeroRedundancy{optimizer_class.__name__}"
    model.compile(optimizer=opt, loss="mse")
    hist = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-6)
    assert max_weight_diff(ref, model) < 1e-12
    slots = [v for v in opt.variables if len(v.shape)]
    assert slots
    for slot in slots:  # every slot of the 16->32->8 MLP has a dim divisible by 8
        assert local_numel(slot) * 8 == int(np.prod(slot.shape)), slot.path
    for v in model.trainable_variables:  # the parameters stay whole (data parallel)
        assert local_numel(v) == int(np.prod(v.shape))


def test_update_is_all_gathered_and_state_dict_round_trips():
    data_parallel()
    model = make_mlp()
    opt = ZeroRedundancyOptimizer(None, keras.optimizers.Adam, learning_rate=1e-3)
    model.compile(optimizer=opt, loss="mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    with CommDebugMode() as comm:
        step(tf.constant(X[:16]), tf.constant(Y[:16]))
    assert comm.get_comm_counts().get("all_gather_into_tensor") == 4  # one per parameter update
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict()
    assert {v.path for v in opt.variables} == set(state)
    before = {k: v.copy() for k, v in state.items()}
    for v in opt.variables:
        if len(v.shape):
            v.assign(np.zeros(v.shape))
    opt.load_state_dict(before)
    for path, value in opt.state_dict().items():
        np.testing.assert_array_equal(value, before[path])
    with pytest.raises(ValueError, match="lacks"):
        opt.load_state_dict({})


def test_bad_arguments():
    with pytest.raises(ValueError, match="optimizer_class"):
        ZeroRedundancyOptimizer(None, "adam")
    with pytest.raises(ValueError, match="process_group"):
        ZeroRedundancyOptimizer(None, keras.optimizers.Adam, process_group=object())
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="1-D"):
        ZeroRedundancyOptimizer(None, keras.optimizers.Adam, mesh=mesh)


def test_post_local_sgd_is_refused_with_the_reason():
    """The reason, reproduced: a 'replicated' DTensor cannot hold diverging copies -- TF reads one."""
    from tfdist.optim import PostLocalSGDOptimizer

    with pytest.raises(NotImplementedError, match="one global value"):
        PostLocalSGDOptimizer(keras.optimizers.SGD(0.1), averager=None)
    mesh = dtensor.create_mesh([("dp", 8)], device_type="CPU")
    copies = dtensor.pack([tf.constant([float(i)]) for i in range(8)], dtensor.Layout.replicated(mesh, 1))
    assert float(tf.reduce_sum(copies).numpy()) == 0.0  # not 28: TF computes with one copy
