"""FSDP (fully_shard) on 8 virtual CPUs: state bytes per device, peak memory, bytes sent, step time.

Model: 4 Dense(1024, tanh) layers (16.8 MB of float32 parameters), Adam,
global batch 64, MSE.  Programs, timed in interleaved rounds on the same
batch, all computing the same first-step loss:

* ``fsdp``: fully_shard on every layer and the model (reshard_after_forward=True);
* ``fsdp-keep``: the same with reshard_after_forward=False;
* ``hsdp 2x4`` / ``hsdp 4x2``: fully_shard on a 2-D (replicate, shard) mesh (HSDP);
* ``fsdp + cpu offload``: ``fsdp`` with ``CPUOffloadPolicy()``: shards and Adam state on the
  host mesh between steps, copied to the devices for each step, the optimizer step on the host;
* ``tfdist-dp``: replicated weights, batch split (keras.distribution.DataParallel on tfdist);
* ``tfdist-dp + ZeRO``: the same with ``tfdist.optim.ZeroRedundancyOptimizer`` (Adam state sharded);
* ``mirrored``: Keras ``model.fit`` machinery under ``tf.distribute.MirroredStrategy``.

Measured:
* bytes of parameters + gradients + optimizer state held per device for a
  data-parallel size N = 1, 2, 4, 8 (local shapes of the variables and of
  the gradients TF returns), against total / N;
* peak memory of one training step, from TF's allocator statistics (the 8
  virtual CPUs share one host allocator: the peak is for all 8, divided by 8);
* bytes each device sends per forward+backward, read from the per-device
  programs TF ran, against torch's 3 (N-1)/N x parameter bytes;
* step time (train_on_batch), median over rounds;
* bytes of parameters + optimizer state left on the device mesh between steps (CPU offload: none;
  on this CPU-only host the host mesh is the same memory, see docs/fsdp.md);
* gradient accumulation over 4 micro-batches of 16: reducing every
  micro-batch against ``set_requires_gradient_sync(False)`` for the first 3
  (held unreduced, one reduce-scatter at the 4th): bytes each device sends
  (CommDebugMode), the gradient bytes held per device, time for the 4
  micro-batches, and that both give the same summed gradients.

    python benchmarks/fsdp.py            # writes benchmarks/results/fsdp.json
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

from _common import executed_collective_bytes, print_table, write_results  # noqa: E402
from tfdist.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard  # noqa: E402
from tfdist.fsdp._offload import is_host_mesh, is_offloaded  # noqa: E402
from tfdist.fsdp._fully_shard import _group_states  # noqa: E402
from tfdist.optim import ZeroRedundancyOptimizer  # noqa: E402

DIM, DEPTH, BATCH = 1024, 4, 64
ROUNDS = int(os.environ.get("ROUNDS", "5"))
RNG = np.random.default_rng(0)
X = RNG.standard_normal((BATCH, DIM)).astype("float32")
Y = RNG.standard_normal((BATCH, DIM)).astype("float32")
MSE = keras.losses.MeanSquaredError()


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((DIM,))] + [keras.layers.Dense(DIM, activation="tanh", name=f"d{i}") for i in range(DEPTH)]
    )


def compiled(model: keras.Model) -> keras.Model:
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def fsdp_model(mesh, reshard=True, offload=OffloadPolicy()) -> keras.Model:
    model = make_model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    return compiled(fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload))


def _on_host_mesh(variable) -> bool:
    """An optimizer variable stored with offloaded parameters: on a host mesh."""
    inner = getattr(variable, "_value", None)
    return isinstance(inner, dtensor.DVariable) and is_host_mesh(dtensor.fetch_layout(inner.read_value()).mesh)


def local_bytes(t) -> int:
    value = t._value.read_value() if hasattr(t, "_value") and hasattr(t._value, "read_value") else t
    if dtensor.is_dtensor(value):
        value = dtensor.unpack(value)[0]
    return int(np.prod(value.shape)) * value.dtype.size


def state_bytes(model: keras.Model) -> dict:
    """Per-device bytes of parameters, their gradients and the optimizer state after one step."""
    model.train_on_batch(X, Y)
    with tf.GradientTape() as tape:
        loss = MSE(Y, model(X))  # a Keras loss puts the host labels on the mesh
    grads = tape.gradient(loss, model.trainable_variables)
    slots = [v for v in model.optimizer.variables if len(v.shape)]
    return {
        "params": sum(local_bytes(v) for v in model.trainable_variables),
        "grads": sum(local_bytes(g) for g in grads),
        "optimizer": sum(local_bytes(v) for v in slots),
    }


def sharding_rows() -> list[dict]:
    rows = []
    total = None
    for n in (1, 2, 4, 8):
        mesh = tfdist.init_device_mesh("cpu", (8 // n, n), mesh_dim_names=("r", "dp"))
        got = state_bytes(fsdp_model(mesh["dp"]))
        held = sum(got.values())
        total = total or held
        rows.append({
            "N": n, "params MB": round(got["params"] / 1e6, 2), "grads MB": round(got["grads"] / 1e6, 2),
            "optimizer MB": round(got["optimizer"] / 1e6, 2), "held MB": round(held / 1e6, 2),
            "held / (total/N)": round(held / (total / n), 3),
        })
    return rows


def enable_allocator_stats() -> None:
    """TF counts host allocations only once a profiler session has run."""
    import tempfile

    tf.profiler.experimental.start(tempfile.mkdtemp())
    tf.profiler.experimental.stop()


def peak_step_bytes(model: keras.Model) -> int:
    """Peak bytes a training step adds to what is already allocated (the process also holds the
    other programs' models), plus the model's own persistent state: all 8 devices together; -1 where
    TF keeps no host allocator statistics (the table then says so)."""
    model.train_on_batch(X, Y)  # traced and optimizer built
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
    except ValueError:  # some TF builds keep no host allocator stats ("Allocator stats not available")
        return -1
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.train_on_batch(X, Y)
    added = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    held = sum(local_bytes(v) * 8 for v in model.trainable_variables + list(model.optimizer.variables))
    return added + held


def sent_bytes(model: keras.Model) -> float:
    """Bytes one device sends in a forward + backward (a fresh tf.function: TF exports its programs once)."""

    @tf.function
    def grads(x, y):
        with tf.GradientTape() as tape:
            loss = MSE(y, model(x))
        return tape.gradient(loss, model.trainable_variables)

    x, y = tf.constant(X), tf.constant(Y)
    return sum(executed_collective_bytes(lambda: grads(x, y)).values())


class MirroredWorker:
    """MirroredStrategy in its own process: its collectives and TF DTensor's share group keys
    (a group of 8 meets DTensor's group of 2 under one key), so they cannot run in one process.
    The parent asks for a step, a timed round or the peak; the rounds stay interleaved."""

    def __init__(self) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--mirrored-worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, what: str) -> float:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the MirroredStrategy worker died")
            if line.startswith("RESULT "):
                return float(line.split()[1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def mirrored_worker() -> None:
    enable_allocator_stats()  # before the first allocation, as in main(): TF refuses stats for CPU:0 otherwise
    strategy = tf.distribute.MirroredStrategy([f"/CPU:{i}" for i in range(8)])
    with strategy.scope():
        model = compiled(make_model())
    for line in sys.stdin:
        what = line.strip()
        if what == "step":
            value = float(np.asarray(model.train_on_batch(X, Y)))
        elif what == "time":
            start = time.perf_counter()
            for _ in range(3):
                model.train_on_batch(X, Y)
            value = (time.perf_counter() - start) / 3 * 1e3
        else:
            with strategy.scope():
                fresh = compiled(make_model())
            value = peak_step_bytes(fresh)
        print(f"RESULT {value}", flush=True)


MICRO = 4


def accumulation_rows() -> list[dict]:
    """Gradients summed over MICRO micro-batches: reduced each time vs held until the last."""
    from tfdist.tensor.debug import CommDebugMode

    mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    xs, ys = np.split(X, MICRO), np.split(Y, MICRO)
    runs = {}
    for name in ("sync every micro-batch", "set_requires_gradient_sync(False)"):
        model = fsdp_model(mesh)

        @tf.function
        def grads_of(x, y, sync, model=model):
            model.set_requires_gradient_sync(sync)
            with tf.GradientTape() as tape:
                loss = MSE(y, model(x))
            return tape.gradient(loss, model.trainable_variables)

        def accumulate(model=model, grads_of=grads_of, held=name != "sync every micro-batch"):
            total = None
            for i in range(MICRO):
                g = grads_of(tf.constant(xs[i]), tf.constant(ys[i]), not held or i == MICRO - 1)
                total = g if total is None or held else [a + b for a, b in zip(total, g)]
            return total

        accumulate()  # traced
        with CommDebugMode() as comm:
            grads = accumulate()
        runs[name] = (accumulate, comm, grads, model)
    want = runs["sync every micro-batch"][2]
    for a, b in zip(want, runs["set_requires_gradient_sync(False)"][2]):
        assert float(tf.reduce_max(tf.abs(a - b))) < 1e-5
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, (accumulate, *_rest) in runs.items():
            start = time.perf_counter()
            accumulate()
            context.async_wait()  # TF may return before its ops have run
            times[name].append((time.perf_counter() - start) * 1e3)
    rows, base = [], None
    for name, (_, comm, _, model) in runs.items():
        sent = sum(comm.get_comm_bytes().values())
        rs = comm.get_comm_bytes().get("reduce_scatter_tensor", 0.0)
        base = base or (sent, rs)
        held = sum(s.grad_sync.held_bytes for s in _group_states(model, recurse=True)) / 8
        rows.append({
            "accumulation (4 micro-batches)": name, "reduce-scatters": comm.get_comm_counts().get(
                "reduce_scatter_tensor", 0), "RS MB sent / device": round(rs / 1e6, 2),
            "all MB sent / device": round(sent / 1e6, 2), "RS bytes vs sync each": round(rs / base[1], 3),
            "held grad MB / device": round(held / 1e6, 2),
            "ms / 4 micro-batches": round(statistics.median(times[name]), 1),
        })
    return rows


def main() -> None:
    keras.distribution.set_distribution(None)
    rows = sharding_rows()
    print_table(rows, list(rows[0]))
    accumulation = accumulation_rows()
    print()
    print_table(accumulation, list(accumulation[0]))
    enable_allocator_stats()
    mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    param_bytes = sum(int(np.prod(v.shape)) * 4 for v in make_model().trainable_variables)
    programs = {"fsdp": lambda: fsdp_model(mesh, True), "fsdp-keep": lambda: fsdp_model(mesh, False),
                "fsdp + cpu offload": lambda: fsdp_model(mesh, True, CPUOffloadPolicy())}
    hsdp = {f"hsdp {r}x{8 // r}": tfdist.init_device_mesh("cpu", (r, 8 // r), mesh_dim_names=("replicate", "shard"))
            for r in (2, 4)}
    for name, hsdp_mesh in hsdp.items():
        programs[name] = lambda hsdp_mesh=hsdp_mesh: fsdp_model(hsdp_mesh, True)

    def data_parallel():
        distribution = keras.distribution.DataParallel(devices=[f"CPU:{i}" for i in range(8)])
        with distribution.scope():
            model = compiled(make_model())
        model._tfdist_bench_scope = distribution
        return model

    def zero():
        distribution = keras.distribution.DataParallel(devices=[f"CPU:{i}" for i in range(8)])
        with distribution.scope():
            model = make_model()
            model.compile(optimizer=ZeroRedundancyOptimizer(None, keras.optimizers.Adam, learning_rate=1e-3),
                          loss="mse")
        model._tfdist_bench_scope = distribution
        return model

    programs["tfdist-dp"] = data_parallel
    programs["tfdist-dp + ZeRO"] = zero
    models = {name: make() for name, make in programs.items()}
    mirrored = MirroredWorker()
    models["mirrored"] = mirrored

    def step(name):
        model = models[name]
        if model is mirrored:
            return mirrored.ask("step")
        scope = getattr(model, "_tfdist_bench_scope", None)
        if scope is None:
            return model.train_on_batch(X, Y)
        with scope.scope():
            return model.train_on_batch(X, Y)

    first = {name: float(np.asarray(step(name))) for name in models}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(ROUNDS):
        for name in models:
            if name == "mirrored":
                times[name].append(mirrored.ask("time"))
                continue
            start = time.perf_counter()
            for _ in range(3):
                step(name)
            times[name].append((time.perf_counter() - start) / 3 * 1e3)
    peaks = {"mirrored": mirrored.ask("peak")}
    mirrored.close()
    for name in programs:  # fresh models: the peak of one step after the first
        model = programs[name]()
        scope = getattr(model, "_tfdist_bench_scope", None)
        if scope is None:
            peaks[name] = peak_step_bytes(model)
        else:
            with scope.scope():
                peaks[name] = peak_step_bytes(model)
    sent = {name: sent_bytes(programs[name]()) for name in ("fsdp", "fsdp-keep", *hsdp)}
    # torch's plan per device: FSDP all-gathers P (S-1)/S in the forward and, with
    # reshard_after_forward, again in the backward, and reduce-scatters the gradient; HSDP then
    # all-reduces the 1/S shard over R replicas (ring: 2 (R-1)/R of it)
    shape = {"fsdp": (1, 8), "fsdp-keep": (1, 8), **{name: tuple(m.shape) for name, m in hsdp.items()}}
    torch_plan = {name: (2 if name == "fsdp-keep" else 3) * (s - 1) / s * param_bytes
                  + 2 * (r - 1) / r * param_bytes / s for name, (r, s) in shape.items()}
    base = statistics.median(times["mirrored"])
    held = {name: sum(local_bytes(v) for v in m.trainable_variables + list(m.optimizer.variables))
            for name, m in models.items() if name != "mirrored"}
    held_mirrored = held["tfdist-dp"]  # a full copy of parameters and Adam state per device
    on_devices = {name: sum(local_bytes(v) for v in m.trainable_variables + list(m.optimizer.variables)
                            if not is_offloaded(v) and not _on_host_mesh(v))
                  for name, m in models.items() if name != "mirrored"}
    timing = []
    for name in models:
        ms = statistics.median(times[name])
        timing.append({
            "program": name, "first loss": round(first[name], 6), "step ms": round(ms, 1),
            "vs mirrored": round(ms / base, 3),
            "params+state MB / device": round(held.get(name, held_mirrored) / 1e6, 2),
            "on devices between steps MB": round(on_devices.get(name, held_mirrored) / 1e6, 2),
            "peak MB / device": round(peaks[name] / 8 / 1e6, 2) if peaks[name] >= 0 else "no allocator stats",
            "MB sent / device": round(sent[name] / 1e6, 2) if name in sent else "",
            "sent / torch's plan": round(sent[name] / torch_plan[name], 3) if name in sent else "",
        })
    print()
    print_table(timing, list(timing[0]))
    losses = [r["first loss"] for r in timing]
    assert max(losses) - min(losses) < 1e-4, losses
    path = write_results("fsdp", rows + timing + accumulation, {
        "model": f"{DEPTH} x Dense({DIM}), Adam, batch {BATCH}", "param_bytes": param_bytes, "rounds": ROUNDS,
        "devices": 8,
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    if "--mirrored-worker" in sys.argv:
        mirrored_worker()
    else:
        main()
