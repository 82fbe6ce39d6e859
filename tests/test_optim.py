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


def test_a_replicated_layout_cannot_hold_diverging_copies():
    """Why DistributedDataParallel's replicas are a stacked [R, ...] variable sharded on dp: a
    'replicated' DTensor given diverging copies computes with one of them."""
    mesh = dtensor.create_mesh([("dp", 8)], device_type="CPU")
    copies = dtensor.pack([tf.constant([float(i)]) for i in range(8)], dtensor.Layout.replicated(mesh, 1))
    assert float(tf.reduce_sum(copies).numpy()) == 0.0  # not 28: TF computes with one copy


def numpy_adam(params, grads_per_step, lr, t0=0, state=None, b1=0.9, b2=0.999, eps=1e-7):
    """Keras' Adam in numpy (global step count for the bias correction, Keras' epsilon placement;
    Keras' bias correction reads the betas in float32, its moments the exact betas)."""
    b1_32, b2_32 = (float(np.float32(a)) for a in (b1, b2))
    state = state if state is not None else {}
    for k, grads in enumerate(grads_per_step):
        t = t0 + k + 1
        for name, g in grads.items():
            m, v = state.get(name, (np.zeros_like(g), np.zeros_like(g)))
            m = m + (g - m) * (1 - b1)
            v = v + (g * g - v) * (1 - b2)
            alpha = lr * np.sqrt(1 - b2_32 ** t) / (1 - b1_32 ** t)
            params[name] = params[name] - alpha * m / (np.sqrt(v) + eps)
            state[name] = (m, v)
    return params, state


def mlp_grads(params, x, y, names):
    """Gradients of the MSE of make_mlp's forward w.r.t. ``names`` (by hand)."""
    h_pre = x @ params["up/kernel"] + params["up/bias"]
    h = np.maximum(h_pre, 0)
    out = h @ params["down/kernel"] + params["down/bias"]
    dout = 2 * (out - y) / out.size
    dh = (dout @ params["down/kernel"].T) * (h_pre > 0)
    all_grads = {"down/kernel": h.T @ dout, "down/bias": dout.sum(0), "up/kernel": x.T @ dh, "up/bias": dh.sum(0)}
    return {n: all_grads[n] for n in names}


def test_add_param_group_takes_unfrozen_layers_with_their_state_sharded(float64):
    """Fine-tuning as torch's add_param_group is meant for: train 'down' with 'up' frozen, unfreeze
    'up' and add it; 'up' starts with fresh state, 'down' keeps its own.  Reference: numpy Adam on
    hand-derived gradients (Keras' global step count for the bias correction)."""
    data_parallel()
    model = make_mlp()
    params = {f"{v.path.split('/')[-2]}/{v.path.split('/')[-1]}": v.numpy() for v in model.trainable_variables}
    model.layers[0].trainable = False
    opt = ZeroRedundancyOptimizer(None, keras.optimizers.Adam, learning_rate=1e-2)
    model.compile(optimizer=opt, loss="mse")
    x, y = X[:16], Y[:16]
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    down = ["down/kernel", "down/bias"]
    ref, state = params, None
    for _ in range(2):
        ref, state = numpy_adam(ref, [mlp_grads(ref, x, y, down)], 1e-2, t0=0 if state is None else 1, state=state)
    for v in model.layers[1].trainable_variables:
        name = "/".join(v.path.split("/")[-2:])
        np.testing.assert_allclose(v.numpy(), ref[name], atol=1e-10, err_msg=name)
    with pytest.raises(ValueError, match="learning_rate"):
        opt.add_param_group({"params": model.layers[0].weights, "lr": 0.5})
    model.layers[0].trainable = True
    opt.add_param_group({"params": model.layers[0].trainable_variables, "lr": 1e-2})
    slots = [v for v in opt.variables if len(v.shape)]
    assert len(slots) == 8 and len({v.path for v in opt.variables}) == len(opt.variables)
    for slot in slots:  # the new slots are sharded too
        assert local_numel(slot) * 8 == int(np.prod(slot.shape)), slot.path
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    every = ["up/kernel", "up/bias"] + down
    for t0 in (2, 3):
        ref, state = numpy_adam(ref, [mlp_grads(ref, x, y, every)], 1e-2, t0=t0, state=state)
    for v in model.trainable_variables:
        name = "/".join(v.path.split("/")[-2:])
        np.testing.assert_allclose(v.numpy(), ref[name], atol=1e-10, err_msg=name)
    with pytest.raises(ValueError, match="params"):
        opt.add_param_group([model.layers[0].kernel])


def _tape_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x))
    return tape.gradient(loss, model.trainable_variables)


def test_step_with_a_closure_trains_like_plain_sgd(float64):
    """``opt.step(closure)`` (torch's ``step``; Keras variables keep no ``.grad``, so the closure's
    loss is differentiated in the step) on the params the optimizer was made with: the same
    weights as one device's SGD written out with a tape; state sharded over the 8 devices."""
    x, y = tf.constant(X[:16]), tf.constant(Y[:16])
    ref = make_mlp()
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, ref(x))
        ref_opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)
    data_parallel()
    model = make_mlp()
    opt = ZeroRedundancyOptimizer(model.trainable_variables, keras.optimizers.SGD, learning_rate=0.1, momentum=0.9)
    step = tf.function(lambda: opt.step(lambda: keras.losses.mean_squared_error(y, model(x))))
    for _ in range(2):
        loss = step()
    grads = tf.function(lambda: _tape_grads(model, x, y))()
    opt.step(grads=grads)  # gradients the caller computed, applied as they are
    assert loss is not None
    assert max_weight_diff(model, ref) < 1e-10
    momentum = [v for v in opt.variables if "momentum" in v.path]
    assert momentum and any(local_numel(v) < int(np.prod(v.shape)) for v in momentum)  # sharded state
    with pytest.raises(TypeError, match="closure must be callable"):
        opt.step(3.0)
