"""Local SGD on 8 virtual CPUs: DistributedDataParallel with post_localSGD_hook and
PostLocalSGDOptimizer against synchronous data parallelism, per training step.

Model: 4 Dense(1024, tanh) layers (16.8 MB of float32 parameters), SGD,
global batch 64, MSE.  Programs, timed in interleaved rounds of 4 steps (one
averaging period) on the same batch (the DDP programs through Keras' ``train_on_batch``):

* ``TF DTensor data parallel``: the same model written on raw TF DTensor
  (replicated DVariables, the batch sharded, TF all-reduces the gradients
  inside the ops, SGD as ``assign_sub``), a traced step -- what TF alone gives;
* ``DDP (sync)``: ``DistributedDataParallel``'s replicas, default hook (the
  replicas' mean gradient: one all-reduce per parameter);
* ``DDP + post-local SGD``: ``post_localSGD_hook`` past its warm-up
  (``start_localSGD_iter=0``, no gradient all-reduce) and
  ``PeriodicModelAverager(period=4)``: 3 local steps and 1 averaging step.

Measured: all-reduces executed per 4 steps (CommDebugMode counts what ran),
the parameter bytes they carry per device (count x each parameter's ring
all-reduce bytes, 2 (N-1)/N: CommDebugMode's byte count reads the program,
which holds both branches of the schedule's ``tf.cond``), and ms per step
(median over rounds).  The first step's loss is checked equal across programs.

    python benchmarks/local_sgd.py        # writes benchmarks/results/local_sgd.json
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

tfdist.virtual_cpus(8)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

from _common import print_table, write_results  # noqa: E402
from tfdist.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook  # noqa: E402
from tfdist.algorithms.model_averaging import averagers  # noqa: E402
from tfdist.nn.parallel import DistributedDataParallel  # noqa: E402
from tfdist.optim import PostLocalSGDOptimizer  # noqa: E402
from tfdist.tensor.debug import CommDebugMode  # noqa: E402

DIM, DEPTH, BATCH, N, PERIOD = 1024, 4, 64, 8, 4
ROUNDS = int(os.environ.get("ROUNDS", "5"))
RNG = np.random.default_rng(0)
X = RNG.standard_normal((BATCH, DIM)).astype("float32")
Y = RNG.standard_normal((BATCH, DIM)).astype("float32")


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((DIM,))] + [keras.layers.Dense(DIM, activation="tanh", name=f"d{i}") for i in range(DEPTH)]
    )


def compiled(model: keras.Model, optimizer=None) -> keras.Model:
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse")
    return model


def raw_dtensor_step(mesh) -> callable:
    """The model as raw TF DTensor data parallelism: replicated weights, sharded batch, SGD."""
    tf_mesh = mesh.root_mesh.to_tf()
    replicated = [dtensor.DVariable(dtensor.copy_to_mesh(tf.constant(w), dtensor.Layout.replicated(tf_mesh, w.ndim)))
                  for w in make_model().get_weights()]
    shard = dtensor.Layout(["dp", dtensor.UNSHARDED], tf_mesh)

    def on_mesh(a):  # the host batch onto the mesh each step, as Keras' train_on_batch does
        return dtensor.relayout(dtensor.copy_to_mesh(tf.constant(a), dtensor.Layout.replicated(tf_mesh, 2)), shard)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            h = x
            for kernel, bias in zip(replicated[::2], replicated[1::2]):
                h = tf.tanh(tf.matmul(h, kernel) + bias)
            loss = tf.reduce_mean(tf.square(h - y))
        for variable, grad in zip(replicated, tape.gradient(loss, replicated)):
            variable.assign_sub(0.01 * grad)
        return loss

    return lambda: step(on_mesh(X), on_mesh(Y))


def programs(mesh) -> dict:
    """name -> one training step."""
    out = {"TF DTensor data parallel": raw_dtensor_step(mesh)}
    sync = compiled(DistributedDataParallel(make_model(), device_mesh=mesh))
    out["DDP (sync)"] = lambda: sync.train_on_batch(X, Y)
    local = DistributedDataParallel(make_model(), device_mesh=mesh)
    local.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=0, post_local_gradient_allreduce=False),
                             post_localSGD_hook)
    compiled(local, PostLocalSGDOptimizer(keras.optimizers.SGD(0.01), averagers.PeriodicModelAverager(period=PERIOD)))
    out["DDP + post-local SGD"] = lambda: local.train_on_batch(X, Y)
    return out


def main() -> None:
    keras.distribution.set_distribution(None)
    mesh = tfdist.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))
    runs = programs(mesh)
    first = {name: float(np.asarray(fn())) for name, fn in runs.items()}
    for name, fn in runs.items():  # complete the first period (the averager's step 0 averaged)
        for _ in range(PERIOD - 1):
            fn()
    counts = {}
    for name, fn in runs.items():
        with CommDebugMode() as comm:
            for _ in range(PERIOD):
                fn()
        counts[name] = comm.get_comm_counts().get("all_reduce", 0)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(PERIOD):
                fn()
            context.async_wait()
            times[name].append((time.perf_counter() - start) / PERIOD * 1e3)
    param_bytes = [DIM * DIM * 4, DIM * 4] * DEPTH
    ring = 2 * (N - 1) / N
    base = statistics.median(times["TF DTensor data parallel"])
    rows = []
    for name in runs:
        loss_reductions = PERIOD  # one scalar all-reduce per step: the loss, a mean over the global batch
        param_reduces = counts[name] - loss_reductions
        per_param = param_reduces / len(param_bytes)
        ms = statistics.median(times[name])
        rows.append({
            "program": name, "first loss": round(first[name], 6),
            "all-reduces / 4 steps": counts[name],
            "parameter MB all-reduced / device / 4 steps": round(per_param * sum(param_bytes) * ring / 1e6, 2),
            "ms / step": round(ms, 1), "vs TF DTensor data parallel": round(ms / base, 3),
        })
    print_table(rows, list(rows[0]))
    losses = [r["first loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-5, losses
    path = write_results("local_sgd", rows, {
        "model": f"{DEPTH} x Dense({DIM}), SGD, batch {BATCH}", "period": PERIOD, "rounds": ROUNDS, "devices": N,
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
