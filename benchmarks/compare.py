"""One command that compares Keras training on tfdist with every baseline, side by side.

    python benchmarks/compare.py [--rounds 5] [--workloads W1,W2] [--programs ...]

Workloads (Adam, the same initial weights and data in every program):

- W1: a 2-layer MLP, 1024 -> 1024 (gelu) -> 1024, 2.1M parameters, MSE, batch 64, 100 steps;
- W2: ``tfdist.models.GPT`` (vocab 256, seq 64, dim 128, 8 heads, 2 blocks), 0.5M
  parameters, token cross-entropy, batch 16, 60 steps.

Programs, each run in a fresh process (interleaved: round r runs every program once; the
programs a goal compares run next to each other, forwards in even rounds and backwards in odd
ones, ``round_order``), on 8 virtual CPUs:

- ``one_device``: Keras 3 ``fit`` on one device;
- ``hand_written_one_device``: the same model, loss and Adam by hand in plain TF on one device,
  reading the loss every step (Keras' own loop is the difference to ``one_device`` on W1);
- ``hand_written``: the same by hand in raw TF DTensor on a 2x4 (dp x tp) mesh, Megatron
  layouts, batches packed by dp coordinate; a Python loop of steps that reads the loss only at
  the end of the warm-up and at the ends of the three timed blocks;
- ``hand_written_synced``: that loop reading the loss every step, as Keras 3 ``fit`` on
  TensorFlow does (it converts each batch's logs);
- ``hand_written_dp``: the same by hand in raw TF DTensor, data parallel on a 1-D mesh of 8
  (replicated weights and Adam, batch sharded): what TF DTensor itself costs for data parallel;
- ``tfdist_parallelize``: Keras 3 ``fit`` after ``parallelize_module`` (W2:
  ``parallelize_gpt``, whose default keeps the logits vocabulary-sharded) on 2x4, and
  ``tfdist_parallelize_spe4``: the same with ``steps_per_execution=4``;
- ``tfdist_layout_map``: Keras 3 ``fit`` under ``keras.distribution.ModelParallel`` with a
  ``LayoutMap`` on 2x4 (tfdist makes it work on TensorFlow);
- ``tfdist_data_parallel``: Keras 3 ``fit`` under ``keras.distribution.DataParallel`` on 8;
- ``tf_keras_layout_map``: tf_keras (Keras 2) DTensor ``LayoutMap`` on 2x4, fed by a
  ``DTensorDataset`` (its ``fit`` on arrays fails), with tf_keras' DTensor Adam;
- ``mirrored``: Keras 3 ``fit`` under ``tf.distribute.MirroredStrategy`` on 8;
- ``jax_layout_map``: the same Keras model and ``LayoutMap`` as ``tfdist_layout_map`` on Keras'
  JAX backend (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), the alternative a Keras
  user has today; it starts from one device's TF weights (drawn by ``one_device``'s code in a
  helper process), so its losses are checked like the others'.

Each program reports its steady step time -- the steps after the warm-up are timed in three
consecutive blocks, and a program's step time is its median block's mean step (the mean over
all of them is kept as ``window_ms``, and the process's CPU time per step over them, all
threads, as ``cpu_ms``) -- the first step (trace + compile), how long ``fit`` takes to return after its last step, peak
resident memory, and its logged losses.  The parent checks every program's losses against
the same round's ``one_device``'s at the steps it logged (every round: a ratio with a program
whose losses differ in any round is not printed), takes medians over rounds, computes each goal
ratio as the median over rounds of that round's ratio (with its range), and writes ``results/compare.json``,
``results/compare.md`` (the table docs/performance.md quotes) and ``results/compare.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from _common import RESULTS, host  # noqa: E402  (the results folder; run_all.py --quick moves it)

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = ["one_device", "hand_written_one_device", "hand_written", "hand_written_synced", "hand_written_dp",
            "tfdist_parallelize", "tfdist_parallelize_spe4", "tfdist_layout_map", "tfdist_data_parallel",
            "tf_keras_layout_map", "mirrored", "jax_layout_map"]
WORKLOADS = {
    "W1": dict(kind="mlp", dim=1024, hidden=1024, batch=64, steps=100, warmup=10, lr=1e-3),
    "W2": dict(kind="gpt", vocab=256, seq=64, dim=128, heads=8, depth=2, batch=16, steps=60, warmup=10, lr=1e-3),
}
# Steps every program runs after its timed window.  Keras on a mesh runs callbacks one step
# behind (tfdist's fit), so a mark is taken after the next step was dispatched -- except the
# epoch's final one, which would end the last block early and flatter it; with a tail, every
# block ends at a mark like the others (``_Clock``).
TAIL_STEPS = 4
LOSS_RTOL = 1e-3  # float32 sums in another order, over up to 100 Adam steps
# (name, numerator, denominator, goal or None for a reference row); a ratio is the median over
# rounds of the round's ratio (the programs of a goal run next to each other: round_order)
RATIOS = [
    ("tfdist parallelize_module fit 2x4 / hand-written TF DTensor 2x4", "tfdist_parallelize", "hand_written", 1.02),
    ("tfdist LayoutMap fit 2x4 / hand-written TF DTensor 2x4", "tfdist_layout_map", "hand_written", 1.02),
    ("tfdist parallelize_module fit 2x4, steps_per_execution=4 / hand-written TF DTensor 2x4",
     "tfdist_parallelize_spe4", "hand_written", 1.02),
    ("tfdist parallelize_module fit 2x4 / hand-written 2x4 reading its loss every step, as Keras on TF does",
     "tfdist_parallelize", "hand_written_synced", 1.02),
    ("reference: Keras 3 fit, one device / the same step hand-written, one device (Keras' own loop)",
     "one_device", "hand_written_one_device", None),
    ("tfdist parallelize_module fit 2x4 / tf_keras LayoutMap fit 2x4", "tfdist_parallelize", "tf_keras_layout_map", 0.90),
    ("tfdist LayoutMap fit 2x4 / tf_keras LayoutMap fit 2x4", "tfdist_layout_map", "tf_keras_layout_map", 0.90),
    ("tfdist parallelize_module fit 2x4 / Keras on JAX LayoutMap fit 2x4", "tfdist_parallelize", "jax_layout_map", 1.00),
    ("tfdist LayoutMap fit 2x4 / Keras on JAX LayoutMap fit 2x4", "tfdist_layout_map", "jax_layout_map", 1.00),
    ("tfdist DataParallel fit 8 / MirroredStrategy fit 8", "tfdist_data_parallel", "mirrored", 1.00),
    ("tfdist DataParallel fit 8 / hand-written TF DTensor data parallel 8", "tfdist_data_parallel", "hand_written_dp", 1.02),
]


# ----------------------------------------------------------------------------- worker side

def _data(w: dict):
    rng = np.random.default_rng(0)
    n = w["batch"] * (w["steps"] + TAIL_STEPS)
    if w["kind"] == "mlp":
        x = rng.standard_normal((n, w["dim"])).astype(np.float32)
        return x, np.tanh(x[:, ::-1]).astype(np.float32)
    ids = rng.integers(0, w["vocab"], (n, w["seq"] + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


def _keras_model(keras, w: dict):
    keras.utils.set_random_seed(0)
    if w["kind"] == "mlp":
        return keras.Sequential([keras.Input((w["dim"],)), keras.layers.Dense(w["hidden"], activation="gelu", name="up"),
                                 keras.layers.Dense(w["dim"], name="down")], name="mlp")
    from tfdist.models import GPT  # a stock-Keras model: importing it loads tfdist's package, not its Keras plug-in

    model = GPT(w["vocab"], w["seq"], w["dim"], w["heads"], w["depth"], name="gpt")
    model(np.zeros((1, w["seq"]), "int32"))
    return model


def _loss(keras, w: dict):
    return "mse" if w["kind"] == "mlp" else keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _scalar(t) -> float:
    if "tensorflow" not in sys.modules:  # Keras on JAX: a jax array
        return float(np.asarray(t))
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    if isinstance(t, tf.Tensor) and dtensor.is_dtensor(t):
        t = dtensor.unpack(t)[0]
    return float(np.asarray(t))


class _Clock:
    """Times of the steps, by step index.  A hand-written loop synchronises (reads the loss)
    only at step 0 and at the ends of the timed blocks, so the steps in between may overlap
    feeding and compute -- or at every step (``sync_every_step``), as Keras 3's ``fit`` on
    TensorFlow does when it converts each batch's logs.  Keras reports to it every
    ``steps_per_execution`` steps; then the mark that ends a block is the first at or after
    its bound, and that mark synchronises (a mark between syncs is only a dispatch time: with
    the step still computing, a block ending there would look shorter than it ran).

    The steps after warm-up are timed in ``BLOCKS`` consecutive blocks; a program's step
    time is its median block's mean, so a burst of work from elsewhere on the host that
    lands in one block (this 2-core VM has them, seconds long) moves no program's time,
    whichever program it hits.  ``window_ms`` is the mean over all the timed steps."""

    BLOCKS = 3

    def __init__(self, w: dict, sync_every_step: bool = False) -> None:
        self.warmup, self.steps = w["warmup"], w["steps"]
        first, last = self.warmup - 1, self.steps - 1
        self.bounds = [first + round(k * (last - first) / self.BLOCKS) for k in range(self.BLOCKS + 1)]
        self.sync_at = set(range(self.steps)) if sync_every_step else {0, *self.bounds}
        self.marks: dict[int, tuple[float, object]] = {}  # step -> (time it ended, its loss)
        self.cpu: dict[int, float] = {}
        self.start = time.perf_counter()

    def step_done(self, i: int, loss) -> None:
        previous = max(self.marks, default=-1)
        if i in self.sync_at or any(previous < b <= i for b in (0, *self.bounds)):
            _scalar(loss)
        self.marks[i] = (time.perf_counter(), loss)
        self.cpu[i] = time.process_time()  # the process's CPU, all threads: on 2 cores any extra is wall time

    def block_ends(self) -> list[int]:
        """The marked steps that end the blocks: for each bound the first step marked at or
        after it, which ``step_done`` synchronised (Keras marks every ``steps_per_execution``
        steps).  The run's final mark ends none while a later one exists (``TAIL_STEPS``)."""
        steps = sorted(self.marks)
        return sorted({min((i for i in steps if i >= b), default=steps[-1]) for b in self.bounds})

    def report(self, returned: float, running_mean: bool) -> dict:
        steps = sorted(self.marks)
        losses = [_scalar(self.marks[i][1]) for i in steps]
        if not running_mean:  # Keras logs the epoch's running mean; a hand-written loop its own loss
            losses = list(np.cumsum(losses) / np.arange(1, len(losses) + 1))
        ends = self.block_ends()
        per_step = lambda a, b: (self.marks[b][0] - self.marks[a][0]) / (b - a) * 1e3  # noqa: E731
        blocks = [per_step(a, b) for a, b in zip(ends, ends[1:])]
        cpu_ms = (self.cpu[ends[-1]] - self.cpu[ends[0]]) / (ends[-1] - ends[0]) * 1e3 if self.cpu else None
        return {"step_ms": float(np.median(blocks)), "window_ms": per_step(ends[0], ends[-1]), "cpu_ms": cpu_ms,
                "block_ms": [round(b, 3) for b in blocks], "first_step_s": self.marks[steps[0]][0] - self.start,
                "fit_return_s": returned - self.marks[steps[-1]][0], "loss_steps": steps, "losses": losses}


def _keras_callback(base, clock: _Clock):
    class Timer(base):
        # it only records; so Keras may run it behind the next step where its backend allows
        # (tfdist on a mesh does; Keras on TF, alone, never does), as it would a progress bar
        async_safe = True

        def on_train_begin(self, logs=None):
            clock.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            clock.step_done(batch, logs["loss"])

    return Timer()


def _fit(keras, model, w: dict, x, y, steps_per_execution: int = 1) -> dict:
    model.compile(optimizer=keras.optimizers.Adam(w["lr"]), loss=_loss(keras, w),
                  steps_per_execution=steps_per_execution)
    clock = _Clock(w)
    model.fit(x, y, batch_size=w["batch"], epochs=1, shuffle=False, verbose=0,
              callbacks=[_keras_callback(keras.callbacks.Callback, clock)])
    return clock.report(time.perf_counter(), running_mean=True)


def _virtual_cpus(n: int = 8, split_cores: bool = True) -> None:
    """``n`` logical CPUs for a baseline without tfdist, each op on its device's share of the
    cores as ``tfdist.virtual_cpus`` sets it (written out here, not imported): the TF
    baselines on 8 devices then differ from tfdist by the library, not by a thread setting a
    user of theirs can make too (its effect alone: docs/performance.md)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    if n > 1 and split_cores:
        tf.config.threading.set_intra_op_parallelism_threads(max(1, len(os.sched_getaffinity(0)) // n))


def run_one_device(w, x, y):
    import keras

    return _fit(keras, _keras_model(keras, w), w, x, y)


def run_mirrored(w, x, y):
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy([f"/CPU:{i}" for i in range(8)])
    with strategy.scope():
        model = _keras_model(keras, w)
        return _fit(keras, model, w, x, y)


def run_hand_written_dp(w, x, y):
    return run_hand_written(w, x, y, shape=(8, 1))


def run_hand_written_synced(w, x, y):
    return run_hand_written(w, x, y, sync_every_step=True)


def run_hand_written_one_device(w, x, y):
    return run_hand_written(w, x, y, shape=None, sync_every_step=True)


def run_hand_written(w, x, y, shape=(2, 4), sync_every_step=False):
    """The step by hand in raw TF DTensor on a (dp, tp) mesh of ``shape`` (None: plain TF on one
    device), in a Python loop of steps."""
    import keras
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    import _handwritten

    mesh = None if shape is None else dtensor.create_mesh([("dp", shape[0]), ("tp", shape[1])],
                                                          devices=[f"CPU:{i}" for i in range(8)])
    step = _handwritten.train_step(_keras_model(keras, w), mesh, w)

    def place(batch):
        return tf.constant(batch) if mesh is None else _handwritten.place_by_dp(batch, mesh, shape)

    clock = _Clock(w, sync_every_step)
    b = w["batch"]
    for i in range(w["steps"] + TAIL_STEPS):
        clock.step_done(i, step(place(x[i * b:(i + 1) * b]), place(y[i * b:(i + 1) * b])))
    return clock.report(time.perf_counter(), running_mean=False)


def _gpt_layout_map():
    """The GPT plan as keras.distribution LayoutMap keys (variable paths of a fresh process)."""
    rules = {
        "gpt/embedding/embeddings": ("model", None),
        ".*/(query|key|value)/kernel": (None, "model", None),
        ".*/(query|key|value)/bias": ("model", None),
        ".*/attention_output/kernel": ("model", None, None),
        ".*/mlp/dense/kernel": (None, "model"), ".*/mlp/dense/bias": ("model",),
        ".*/mlp_1/dense_2/kernel": (None, "model"), ".*/mlp_1/dense_2/bias": ("model",),
        ".*/mlp/dense_1/kernel": ("model", None), ".*/mlp_1/dense_3/kernel": ("model", None),
        "gpt/dense_4/kernel": (None, "model"),
    }
    return rules


def _tfdist_keras(distribution_of, w, x, y):
    """The model built (seeded) under the distribution: tfdist initialises the same weights on
    any mesh as on one device (the loss check against ``one_device`` confirms it), so, like
    the baselines, the process holds one model only."""
    import keras

    import tfdist

    tfdist.virtual_cpus(8)
    import tfdist.keras  # noqa: F401  (the Keras plug-in)

    keras.distribution.set_distribution(distribution_of(keras))
    model = _keras_model(keras, w)
    return _fit(keras, model, w, x, y)


def run_tfdist_layout_map(w, x, y):
    def distribution(keras):
        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in _layout_map_rules(w).items():
            layout_map[key] = axes
        return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")

    return _tfdist_keras(distribution, w, x, y)


def _layout_map_rules(w: dict) -> dict:
    if w["kind"] == "mlp":
        return {".*/up/kernel": (None, "model"), ".*/up/bias": ("model",), ".*/down/kernel": ("model", None)}
    return _gpt_layout_map()


def run_jax_layout_map(w, x, y):
    """Keras on JAX with the LayoutMap of ``tfdist_layout_map``, from one device's TF weights."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.npz")
        workload = next(k for k, v in WORKLOADS.items() if v is w)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--initial-weights", workload, path],
                       check=True, capture_output=True,
                       env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                            "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"})
        with np.load(path) as saved:
            weights = [saved[f"w{i}"] for i in range(len(saved.files))]
    import keras

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in _layout_map_rules(w).items():
        layout_map[key] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = _keras_model(keras, w)
    model.set_weights(weights)
    return _fit(keras, model, w, x, y)


def initial_weights(workload: str, path: str) -> None:
    """One device's initial weights of ``workload``'s Keras model (TF backend), saved to ``path``."""
    _virtual_cpus(8)
    import keras

    weights = _keras_model(keras, WORKLOADS[workload]).get_weights()
    np.savez(path, **{f"w{i}": v for i, v in enumerate(weights)})


def run_tfdist_data_parallel(w, x, y):
    return _tfdist_keras(lambda keras: keras.distribution.DataParallel(), w, x, y)


def run_tfdist_parallelize_spe4(w, x, y):
    return run_tfdist_parallelize(w, x, y, steps_per_execution=4)


def run_tfdist_parallelize(w, x, y, steps_per_execution=1):
    import keras

    import tfdist

    tfdist.virtual_cpus(8)
    import tfdist.keras  # noqa: F401
    from tfdist.models import parallelize_gpt
    from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = _keras_model(keras, w)
    if w["kind"] == "mlp":
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    else:  # the default plan: logits stay vocabulary-sharded, fit computes the loss on them (loss_parallel)
        parallelize_gpt(model, mesh)
    return _fit(keras, model, w, x, y, steps_per_execution)


def run_tf_keras_layout_map(w, x, y):
    import keras
    import tensorflow as tf
    import tf_keras
    from tensorflow.experimental import dtensor
    from tf_keras.dtensor import experimental as kdt

    import _handwritten

    U = dtensor.UNSHARDED
    weights = _keras_model(keras, w).get_weights() if w["kind"] == "mlp" else None
    mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
    layout_map = kdt.LayoutMap(mesh=mesh)
    tf_keras.backend.experimental.enable_tf_random_generator()  # its DTensor API requires it
    tf_keras.utils.set_random_seed(0)
    if w["kind"] == "mlp":
        layout_map["up.kernel"] = dtensor.Layout([U, "model"], mesh)
        layout_map["up.bias"] = dtensor.Layout(["model"], mesh)
        layout_map["down.kernel"] = dtensor.Layout(["model", U], mesh)
        with layout_map.scope():
            inp = tf_keras.Input((w["dim"],))
            h = tf_keras.layers.Dense(w["hidden"], activation="gelu", name="up")(inp)
            model = tf_keras.Model(inp, tf_keras.layers.Dense(w["dim"], name="down")(h))
        model.set_weights(weights)
        loss = "mse"
    else:
        model = _handwritten.tf_keras_gpt(mesh, "model", w["vocab"], w["seq"], w["dim"], w["heads"], w["depth"])
        loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=kdt.optimizers.Adam(w["lr"], mesh=mesh), loss=loss)
    layout = lambda rank: dtensor.Layout(["batch"] + [U] * (rank - 1), mesh)  # noqa: E731
    data = dtensor.DTensorDataset(tf.data.Dataset.from_tensor_slices((x, y)), mesh=mesh,
                                  layouts=(layout(x.ndim), layout(y.ndim)), global_batch_size=w["batch"],
                                  batch_dim="batch")
    clock = _Clock(w)
    model.fit(data, steps_per_epoch=w["steps"] + TAIL_STEPS, epochs=1, verbose=0,
              callbacks=[_keras_callback(tf_keras.callbacks.Callback, clock)])
    report = clock.report(time.perf_counter(), running_mean=True)
    if w["kind"] != "mlp":
        report["own_initial_weights"] = True
    return report


def worker(program: str, workload: str) -> None:
    import resource

    sys.path.insert(0, HERE)
    if program.startswith("jax"):
        os.environ.update(KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    elif not program.startswith("tfdist"):
        # the baselines run without tfdist in the process; one device keeps every core
        _virtual_cpus(8, split_cores=not program.endswith("one_device"))
    w = WORKLOADS[workload]
    x, y = _data(w)
    try:
        result = globals()[f"run_{program}"](w, x, y)
    except Exception as err:  # noqa: BLE001 - a baseline that cannot run this workload is a result
        result = {"error": f"{type(err).__name__}: {next((ln for ln in str(err).splitlines() if 'rror' in ln), str(err).splitlines()[0] if str(err) else '')[:200]}"}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- parent side

# Programs whose ratios are goals run next to each other: this host's slow spells last
# minutes, and two programs a minute apart can land on either side of one.
GROUPS = [["tfdist_parallelize", "hand_written", "tfdist_layout_map", "jax_layout_map", "hand_written_synced",
           "tfdist_parallelize_spe4", "tf_keras_layout_map"],
          ["tfdist_data_parallel", "mirrored", "hand_written_dp"],
          ["one_device", "hand_written_one_device"]]


def round_order(programs: list[str], r: int) -> list[str]:
    """The order of round ``r``: the groups rotated by the round, each run forwards in even
    rounds and backwards in odd ones (so neither program of a pair is always the later one);
    programs in no group run last."""
    groups = [[p for p in group if p in programs] for group in GROUPS]
    groups = groups[r % len(groups):] + groups[:r % len(groups)]
    order = [p for group in groups for p in (group if r % 2 == 0 else group[::-1])]
    return order + [p for p in programs if p not in order]


def run_worker(program: str, workload: str, timeout: float = 900) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", program, workload],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] }"}
    return json.loads(lines[-1][len("RESULT "):])


def _loss_diff(result: dict, reference: dict) -> float:
    """Largest relative difference between a program's logged losses and one device's, at the
    steps it logged (Keras logs every ``steps_per_execution`` steps)."""
    steps = result.get("loss_steps", range(len(result["losses"])))
    want = np.array([reference[i] for i in steps])
    return float(np.max(np.abs(np.array(result["losses"]) - want) / np.abs(want)))


def _one_device_losses(by_program: dict) -> list[dict | None]:
    """Per round, one device's losses by step (None where that round has none)."""
    return [None if "losses" not in r else dict(zip(r.get("loss_steps", range(len(r["losses"]))), r["losses"]))
            for r in by_program.get("one_device", [])]


def _round_loss_diffs(results: list[dict], references: list[dict | None]) -> list[float | None]:
    """Each round's loss difference against the same round's one device (the first round's where
    that one failed); None for a run that failed or starts from its own weights."""
    fallback = next((r for r in references if r is not None), None)
    out = []
    for i, r in enumerate(results):
        ref = references[i] if i < len(references) and references[i] is not None else fallback
        out.append(None if "losses" not in r or ref is None or r.get("own_initial_weights") else _loss_diff(r, ref))
    return out


def summarize(runs: dict) -> dict:
    """Medians over rounds, and each program's losses against one device's, every round."""
    out = {}
    for workload, by_program in runs.items():
        references = _one_device_losses(by_program)
        out[workload] = {}
        for program, results in by_program.items():
            ok = [r for r in results if "error" not in r]
            if not ok:
                out[workload][program] = {"error": results[0]["error"], "peak_rss_mb": results[0].get("peak_rss_mb")}
                continue
            row = {k: float(np.median([r[k] for r in ok])) for k in ("step_ms", "first_step_s", "fit_return_s", "peak_rss_mb")}
            row["rounds"] = len(ok)
            row["step_ms_per_round"] = [round(r["step_ms"], 2) for r in ok]
            for field in ("window_ms", "cpu_ms"):
                if all(r.get(field) is not None for r in ok):
                    row[field] = float(np.median([r[field] for r in ok]))
            diffs = [d for d in _round_loss_diffs(ok, references) if d is not None]
            if diffs:
                row["loss_rel_diff"] = max(diffs)  # the worst round
                row["losses_agree"] = max(diffs) <= LOSS_RTOL
            else:
                row["losses_agree"] = None  # not comparable: its own initial weights, or no one-device run
                row["loss_check"] = "own init" if ok[0].get("own_initial_weights") else "no one_device run"
            out[workload][program] = row
    return out


def _paired(runs_a: list, runs_b: list, key: str) -> list[float]:
    """The ratio a/b of ``key`` in each round where both programs ran."""
    return [a[key] / b[key] for a, b in zip(runs_a, runs_b) if a.get(key) is not None and b.get(key)]


def ratios(runs: dict) -> list[dict]:
    """Each ratio: the median over rounds of that round's ratio, and its range over rounds."""
    rows = []
    for name, num, den, goal in RATIOS + [("peak memory: tfdist DataParallel / MirroredStrategy",
                                           "tfdist_data_parallel", "mirrored", 1.00)]:
        key = "peak_rss_mb" if name.startswith("peak memory") else "step_ms"
        row = {"ratio": name, "goal": goal}
        for workload, by_program in runs.items():
            references = _one_device_losses(by_program)
            wrong = [p for p in (num, den) if any(d is not None and d > LOSS_RTOL for d in _round_loss_diffs(
                [r for r in by_program.get(p, []) if "error" not in r], references))]
            if wrong:  # a program that computes something else has no speed to compare
                row[workload], row[f"{workload}_range"] = None, None
                row[f"{workload}_check"] = f"losses differ from one device: {', '.join(wrong)}"
                continue
            per_round = _paired(by_program.get(num, []), by_program.get(den, []), key)
            row[workload] = round(float(np.median(per_round)), 3) if per_round else None
            row[f"{workload}_range"] = [round(min(per_round), 3), round(max(per_round), 3)] if per_round else None
            if key == "step_ms":  # the same ratio on the whole timed window, and on process CPU per step
                for extra, field in (("window", "window_ms"), ("cpu", "cpu_ms")):
                    paired = _paired(by_program.get(num, []), by_program.get(den, []), field)
                    row[f"{workload}_{extra}"] = round(float(np.median(paired)), 3) if paired else None
        rows.append(row)
    return rows


def markdown(summary: dict, ratio_rows: list[dict], meta: dict) -> str:
    workloads = list(summary)
    lines = [f"Produced by `{meta['command']}` at commit {meta['commit']} ({meta['rounds']} rounds, fresh processes).", "",
             "| program | " + " | ".join(f"{w} step ms | {w} first step s | {w} fit returns s | {w} peak MB | {w} losses = one device"
                                        for w in workloads) + " |",
             "| --- |" + " --- | --- | --- | --- | --- |" * len(workloads)]
    for program in PROGRAMS:
        cells = []
        for w in workloads:
            row = summary[w].get(program)
            if row is None:
                cells += [""] * 5
            elif "error" in row:
                cells += [f"fails: {row['error'][:90]}", "", "", "", ""]
            else:
                agree = row["losses_agree"]
                agree = row["loss_check"] if agree is None else "yes" if agree else f"no ({row['loss_rel_diff']:.1e})"
                cells += [f"{row['step_ms']:.1f}", f"{row['first_step_s']:.1f}", f"{row['fit_return_s']:.2f}",
                          f"{row['peak_rss_mb']:.0f}", agree]
        lines.append(f"| {program} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio (median of per-round ratios; range over rounds; window: on whole-window means; cpu: on process CPU per step) | goal | " + " | ".join(workloads) + " |",
              "| --- | --- |" + " --- |" * len(workloads)]
    for row in ratio_rows:
        cells = [row.get(w + "_check", "n/a") if row[w] is None else f"{row[w]:.2f} ({row[w + '_range'][0]:.2f}-{row[w + '_range'][1]:.2f})"
                 + "".join(f"; {extra} {row[w + '_' + extra]:.2f}" for extra in ("window", "cpu")
                           if row.get(w + "_" + extra) is not None)
                 for w in workloads]
        goal = "--" if row["goal"] is None else f"<= {row['goal']:.2f}"
        lines.append(f"| {row['ratio']} | {goal} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4))
    for ax, (workload, by_program) in zip(np.atleast_1d(axes), summary.items()):
        names = [p for p in PROGRAMS if "step_ms" in by_program.get(p, {})]
        ax.barh(names, [by_program[p]["step_ms"] for p in names], color=["C1" if p.startswith("tfdist") else "C0" for p in names])
        ax.invert_yaxis()
        ax.set_xlabel("median ms per training step")
        ax.set_title(f"{workload} (8 virtual CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    programs = args.programs.split(",")
    workloads = args.workloads.split(",")
    runs: dict = {w: {p: [] for p in programs} for w in workloads}
    for r in range(args.rounds):
        order = round_order(programs, r)
        for workload in workloads:
            for program in order:
                result = run_worker(program, workload)
                runs[workload][program].append(result)
                shown = f"{result['step_ms']:.1f} ms/step" if "step_ms" in result else result["error"][:100]
                print(f"round {r + 1}/{args.rounds} {workload} {program:<22} {shown}", flush=True)
    summary = summarize(runs)
    ratio_rows = ratios(runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    meta = {"command": "python benchmarks/compare.py " + " ".join(sys.argv[1:]), "commit": commit or "unknown",
            "rounds": args.rounds, "workloads": {w: WORKLOADS[w] for w in workloads}, "machine": host()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "ratios": ratio_rows, "runs": runs}, f, indent=1)
    table = markdown(summary, ratio_rows, meta)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(table)
    plot(summary, os.path.join(args.out, "compare.png"))
    print("\n" + table)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "--initial-weights":
        initial_weights(sys.argv[2], sys.argv[3])
    else:
        main()
