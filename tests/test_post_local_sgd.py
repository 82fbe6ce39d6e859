"""Local SGD: DistributedDataParallel's replicas, post_localSGD_hook and PostLocalSGDOptimizer with
PeriodicModelAverager, as torch's docs write them -- against a per-replica numpy reference (each
replica trained on its own rows, gradients averaged during warm-up, parameters every `period`)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from keras_helpers import no_global_distribution, regression_batch, tanh_mlp  # noqa: F401
from tfdist.algorithms.ddp_comm_hooks import default_hooks
from tfdist.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from tfdist.algorithms.model_averaging import averagers
from tfdist.keras._data import gather_to_numpy
from tfdist.nn.parallel import DistributedDataParallel as DDP
from tfdist.optim import PostLocalSGDOptimizer
from tfdist.tensor.debug import CommDebugMode

R, LR, STEPS = 8, 0.1, 7
X, Y = regression_batch(0, 16, 4, 2)
MSE = keras.losses.MeanSquaredError()


def make():
    return tanh_mlp(4, 3, 2)


def dp_mesh():
    return tfdist.init_device_mesh("cpu", (R,), mesh_dim_names=("dp",))


def numpy_grads(w, x, y):
    """Gradients of the MSE of the 4 -> 3 (tanh) -> 2 MLP on one replica's rows, by hand."""
    h = np.tanh(x @ w[0] + w[1])
    out = h @ w[2] + w[3]
    d = 2 * (out - y) / out.size
    dh = d @ w[2].T * (1 - h * h)
    return [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def local_sgd_reference(start, period, warmup, allreduce_after, steps=STEPS):
    """Each replica's weights after ``steps`` SGD steps of torch's post-local SGD."""
    w0 = [w.astype(np.float64) for w in make().get_weights()]
    reps = [[w.copy() for w in w0] for _ in range(R)]
    xs, ys = X.reshape(R, -1, 4), Y.reshape(R, -1, 2)
    for t in range(steps):
        grads = [numpy_grads(reps[r], xs[r], ys[r]) for r in range(R)]
        if t < start or allreduce_after:  # one client: its subgroup is every replica
            mean = [np.mean([g[k] for g in grads], axis=0) for k in range(4)]
            grads = [mean] * R
        reps = [[w - LR * g for w, g in zip(reps[r], grads[r])] for r in range(R)]
        if t >= warmup and (t - warmup) % period == 0:
            avg = [np.mean([rep[k] for rep in reps], axis=0) for k in range(4)]
            reps = [[a.copy() for a in avg] for _ in range(R)]
    return reps


def local_sgd_model(start, period, warmup, allreduce_after=False):
    model = DDP(make(), device_mesh=dp_mesh())
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=start,
                              post_local_gradient_allreduce=allreduce_after)
    model.register_comm_hook(state, post_localSGD_hook)
    opt = PostLocalSGDOptimizer(optim=keras.optimizers.SGD(LR),
                                averager=averagers.PeriodicModelAverager(period=period, warmup_steps=warmup))
    return model, state, opt


def train_step(model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = MSE(y, model(x))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


def assert_replicas(model, reps):
    for k, variable in enumerate(model.trainable_variables):
        got = gather_to_numpy(variable)
        np.testing.assert_allclose(got, np.stack([rep[k] for rep in reps]), rtol=1e-5, atol=1e-6)


def test_replicas_diverge_and_are_averaged_every_period():
    """Traced once: warm-up steps average the gradients (replicas equal), then each replica steps
    on its own rows (replicas differ), and every `period` steps after `warmup_steps` the averager
    makes them equal again; the module's own variables hold that average."""
    model, state, opt = local_sgd_model(start=2, period=3, warmup=2)
    step = train_step(model, opt)
    spreads = []
    for _ in range(STEPS):
        step(tf.constant(X), tf.constant(Y))
        spreads.append(float(np.ptp(gather_to_numpy(model.trainable_variables[3]), axis=0).max()))
    reps = local_sgd_reference(start=2, period=3, warmup=2, allreduce_after=False)
    assert_replicas(model, reps)
    assert spreads[1] < 1e-7 and spreads[2] < 1e-7 and spreads[3] > 1e-3 and spreads[5] < 1e-7 and spreads[6] > 1e-3
    assert state.iter == 2 and opt.averager.step == STEPS
    last_average = local_sgd_reference(start=2, period=3, warmup=2, allreduce_after=False, steps=6)[0]
    for variable, want in zip(model.layers[0].weights + model.layers[1].weights, last_average):
        np.testing.assert_allclose(np.asarray(variable.numpy()), want, rtol=1e-5, atol=1e-6)


def test_collectives_follow_the_schedule():
    """A warm-up step all-reduces each of the 4 gradients once (DDP); a local step runs no
    collective but the loss's (a mean over the global batch: one scalar); an averaging step
    all-reduces each of the 4 parameters once (torch's average_parameters).  Counted from what TF
    executed: the skipped branch of each ``tf.cond`` runs nothing."""
    model, _, opt = local_sgd_model(start=1, period=2, warmup=2)
    step = train_step(model, opt)
    counts = []
    for _ in range(4):
        with CommDebugMode() as comm:
            step(tf.constant(X), tf.constant(Y))
        counts.append(comm.get_comm_counts().get("all_reduce", 0))
    assert counts == [1 + 4, 1, 1 + 4, 1], counts  # step 0 warm-up; 1 local; 2 averaged; 3 local


def test_subgroup_allreduce_on_one_client_keeps_replicas_equal_and_fit_trains():
    """post_local_gradient_allreduce=True on one client: the subgroup is every replica (one torch
    node), so the replicas stay equal; through Keras' compile/fit, eager counters."""
    model, _, opt = local_sgd_model(start=1, period=4, warmup=1, allreduce_after=True)
    model.compile(optimizer=opt, loss="mse")
    model.fit(X, Y, batch_size=16, epochs=STEPS, verbose=0, shuffle=False)
    assert_replicas(model, local_sgd_reference(start=1, period=4, warmup=1, allreduce_after=True))


def test_default_and_compressing_hooks_average_gradients():
    """No hook: DDP's mean (replicas stay equal, = one model on the whole batch); fp16_compress_hook
    reduces in float16 (close to it)."""
    model = DDP(make(), device_mesh=dp_mesh())
    opt = keras.optimizers.SGD(LR)
    step = train_step(model, opt)
    for _ in range(3):
        step(tf.constant(X), tf.constant(Y))
    assert_replicas(model, local_sgd_reference(start=10, period=100, warmup=100, allreduce_after=True, steps=3))

    model = DDP(make(), device_mesh=dp_mesh())
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    step = train_step(model, keras.optimizers.SGD(LR))
    step(tf.constant(X), tf.constant(Y))
    want = local_sgd_reference(start=10, period=100, warmup=100, allreduce_after=True, steps=1)
    got = gather_to_numpy(model.trainable_variables[0])
    np.testing.assert_allclose(got, np.stack([rep[0] for rep in want]), atol=2e-3)


def test_state_dict_keeps_the_averager_step():
    model, _, opt = local_sgd_model(start=0, period=2, warmup=0)
    step = train_step(model, opt)
    for _ in range(3):
        step(tf.constant(X), tf.constant(Y))
    saved = opt.state_dict()
    assert saved["step"] == 3
    opt.averager.step = 0
    opt.load_state_dict(saved)
    assert opt.averager.step == 3
    with pytest.warns(UserWarning, match="no 'step'"):
        opt.load_state_dict({"state": saved["state"]})
    assert opt.averager.step == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="period must be a positive int"):
        averagers.PeriodicModelAverager(period=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        averagers.PeriodicModelAverager(period=2, warmup_steps=-1)
    with pytest.raises(ValueError, match="subgroup must be None"):
        PostLocalSGDState(process_group=None, subgroup=object(), start_localSGD_iter=1)
    with pytest.raises(ValueError, match="model averager"):
        PostLocalSGDOptimizer(optim=keras.optimizers.SGD(0.1), averager=object())
    with pytest.raises(ValueError, match="dim must be 0"):
        DDP(make(), dim=1, device_mesh=dp_mesh())
    model = DDP(make(), device_mesh=dp_mesh())
    with pytest.raises(ValueError, match="split evenly"):
        model(tf.constant(X[:12]))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="already registered"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)


def test_keras_hub_llama_under_ddp_fits_like_one_device():
    """keras-hub's Llama (dict inputs: token ids and padding mask) under DDP through compile/fit: each
    replica runs its rows, the gradients are averaged, and after 2 SGD steps the losses and every
    replica's weights equal one device's."""
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is a test extra: pip install -e '.[test]'")
    hub = dict(vocabulary_size=64, num_layers=2, hidden_dim=32, intermediate_dim=64, num_query_heads=4,
               num_key_value_heads=2)

    def lm():
        keras.utils.set_random_seed(0)
        return keras_hub.models.LlamaCausalLM(backbone=keras_hub.models.LlamaBackbone(**hub), preprocessor=None)

    ids = np.random.default_rng(0).integers(0, 64, (16, 8)).astype("int32")
    x, y = {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, axis=1)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref, model = lm(), DDP(lm(), device_mesh=dp_mesh())
    histories = []
    for m in (ref, model):
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss=sce)
        histories.append(m.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)
    want = {v.path: v.numpy() for v in ref.trainable_variables}
    reps = model._ddp.replicas
    assert len(reps.stacked) == len(want)
    for original, stacked in zip(reps.originals, reps.stacked):
        got = gather_to_numpy(stacked)
        assert got.shape == (R,) + want[original.path].shape
        np.testing.assert_allclose(got, np.broadcast_to(want[original.path], got.shape), atol=1e-6,
                                   err_msg=original.path)


def test_step_with_a_closure_is_torch_s_loop():
    """torch's docs loop (``loss.backward(); opt.step()``) in its TF spelling: ``opt.step(closure)``
    differentiates the closure's loss and applies it, then the averager: the numpy reference of
    post-local SGD, traced."""
    model, _, opt = local_sgd_model(start=2, period=3, warmup=2)

    @tf.function
    def step(x, y):
        return opt.step(lambda: MSE(y, model(x)), variables=model.trainable_variables)

    losses = [float(step(tf.constant(X), tf.constant(Y))) for _ in range(STEPS)]
    assert_replicas(model, local_sgd_reference(start=2, period=3, warmup=2, allreduce_after=False))
    assert losses[-1] < losses[0]

    with pytest.raises(ValueError, match="pass closure .* or grads"):
        opt.step()
    with pytest.raises(ValueError, match="2 gradients for 4 variables"):
        opt.step(grads=[None, None], variables=model.trainable_variables)
