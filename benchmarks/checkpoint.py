"""Distributed checkpoint on 8 virtual CPUs: save/load throughput, resharding, async blocking time.

State: 8 float32 weights of 1024 x 1024 sharded (Shard(0), Shard(1)) on a
2 x 4 mesh plus 8 replicated 1024-vectors (32.0 MB), held as DVariables.
Programs, timed in interleaved rounds (median), each checked to give back
the saved values:

* ``tfdist save``: ``tfdist.checkpoint.save`` of the state dict;
* ``tf.train.Checkpoint write``: TensorFlow's own checkpoint of the same
  DVariables (DTensor's sharded SaveV2 expansion);
* ``tfdist load (same mesh)``: into DVariables of the saving layout;
* ``tf.train.Checkpoint read``: TensorFlow's restore into the same DVariables;
* ``tfdist load (resharded)``: into an 8 x 1 mesh with (Shard(1),), a
  different mesh and different chunks (TF cannot restore onto another mesh);
* ``tfdist async_save (blocking)``: the time ``async_save`` holds the
  training loop (staging + planning), against ``save``; the same for
  ``async_checkpointer_type=PROCESS`` (a persistent writer process writes
  the tensor bundles);
* ``train step during ... async_save``: the mean time of a training-like
  step (a jitted 2x4-mesh matmul chain plus a little Python) run in a loop
  while each kind of save is in flight, against the same step with no save
  running -- what the background writing costs the training loop.

    python benchmarks/checkpoint.py        # writes benchmarks/results/checkpoint.json
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

tfdist.virtual_cpus(8)
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfdist.checkpoint as dcp  # noqa: E402
from tfdist.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402
from _common import print_table, write_results  # noqa: E402
from tfdist.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
N, SIZE = 8, 1024


def make_state(mesh, placements, vector_placements, fill):
    weights = [dtensor.DVariable(distribute_tensor(fill(i, (SIZE, SIZE)), mesh, placements).to_tf())
               for i in range(N)]
    biases = [dtensor.DVariable(distribute_tensor(fill(i, (SIZE,)), mesh, vector_placements).to_tf())
              for i in range(N)]
    return {f"w{i}": v for i, v in enumerate(weights)} | {f"b{i}": v for i, v in enumerate(biases)}


def values(i, shape):
    return np.random.default_rng(i).standard_normal(shape).astype(np.float32)


def zeros(i, shape):
    return np.zeros(shape, np.float32)


def check(state, want):
    for k, v in state.items():
        got = tfdist.tensor.DTensor.from_tf(v.read_value()).numpy()
        np.testing.assert_array_equal(got, want[k], err_msg=k)


def clear(state):
    for v in state.values():
        v.assign(tf.zeros_like(v))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_step(mesh):
    """A training-like step: a chain of sharded matmuls (TF's kernels) plus Python bookkeeping."""
    a = distribute_tensor(values(99, (512, 512)), mesh, [Shard(0), Replicate()]).to_tf()
    w = distribute_tensor(values(98, (512, 512)), mesh, [Replicate(), Replicate()]).to_tf()

    @tf.function
    def matmuls(x, w):
        for _ in range(4):
            x = tf.tanh(tf.matmul(x, w) * 0.01)
        return tf.reduce_sum(x)

    def step():
        total = float(matmuls(a, w))  # waits for the step: the time is the step's, not its dispatch
        log = {f"metric{i}": i * 0.5 for i in range(2000)}  # the Python side of a step (callbacks, logs)
        return total, len(log)

    return step


def step_time_while(step, future=None, min_steps=5) -> float:
    """Mean step time, stepping until ``future`` is done (at least ``min_steps`` steps)."""
    n, start = 0, time.perf_counter()
    while n < min_steps or (future is not None and not future.done()):
        step()
        n += 1
    return (time.perf_counter() - start) / n


def timed_async(source, path, kind, step):
    """(blocking s, total s, mean step s while writing) of one async_save of ``kind``."""
    start = time.perf_counter()
    future = dcp.async_save(dict(source), checkpoint_id=path, async_checkpointer_type=kind)
    blocking = time.perf_counter() - start
    during = step_time_while(step, future, min_steps=1)
    future.result()
    return blocking, time.perf_counter() - start, during


def main() -> None:
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    flat = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))
    source = make_state(mesh, [Shard(0), Shard(1)], [Replicate(), Replicate()], values)
    want = {k: tfdist.tensor.DTensor.from_tf(v.read_value()).numpy() for k, v in source.items()}
    same = make_state(mesh, [Shard(0), Shard(1)], [Replicate(), Replicate()], zeros)
    resharded = make_state(flat, [Shard(1)], [Shard(0)], zeros)
    megabytes = sum(a.nbytes for a in want.values()) / 2**20
    root = tempfile.mkdtemp(prefix="tfdist-ckpt-bench-")
    ours, theirs = os.path.join(root, "dcp"), os.path.join(root, "tf", "ckpt")
    tf_ckpt = tf.train.Checkpoint(**source)
    tf_target = tf.train.Checkpoint(**same)
    samples: dict[str, list[float]] = {k: [] for k in [
        "tfdist save", "tf.train.Checkpoint write", "tfdist load (same mesh)", "tf.train.Checkpoint read",
        "tfdist load (resharded)", "tfdist async_save (blocking)", "tfdist async_save (total)",
        "tfdist async_save PROCESS (blocking)", "tfdist async_save PROCESS (total)",
        "train step, no save", "train step during THREAD async_save", "train step during PROCESS async_save"]}
    step = make_step(mesh)
    for r in range(ROUNDS + 1):  # round 0 warms up (traces, first file creation)
        t = {"tfdist save": timed(lambda: dcp.save(dict(source), checkpoint_id=ours)),
             "tf.train.Checkpoint write": timed(lambda: tf_ckpt.write(theirs))}
        clear(same)
        t["tfdist load (same mesh)"] = timed(lambda: dcp.load(dict(same), checkpoint_id=ours))
        check(same, want)
        clear(same)
        t["tf.train.Checkpoint read"] = timed(lambda: tf_target.read(theirs).assert_consumed())
        check(same, want)
        clear(resharded)
        t["tfdist load (resharded)"] = timed(lambda: dcp.load(dict(resharded), checkpoint_id=ours))
        check(resharded, want)
        t["train step, no save"] = step_time_while(step)
        (t["tfdist async_save (blocking)"], t["tfdist async_save (total)"],
         t["train step during THREAD async_save"]) = timed_async(source, ours, AsyncCheckpointerType.THREAD, step)
        clear(same)
        dcp.load(dict(same), checkpoint_id=ours)
        check(same, want)
        (t["tfdist async_save PROCESS (blocking)"], t["tfdist async_save PROCESS (total)"],
         t["train step during PROCESS async_save"]) = timed_async(source, ours, AsyncCheckpointerType.PROCESS, step)
        clear(same)
        dcp.load(dict(same), checkpoint_id=ours)
        check(same, want)
        if r:
            for k, v in t.items():
                samples[k].append(v)
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [{"program": k, "median_s": round(v, 4),
             "MB/s": "" if k.startswith("train step") else round(megabytes / v, 1)} for k, v in med.items()]
    ratios = {
        "save: tfdist / tf.train.Checkpoint (time)": med["tfdist save"] / med["tf.train.Checkpoint write"],
        "load: tfdist / tf.train.Checkpoint (time)": med["tfdist load (same mesh)"] / med["tf.train.Checkpoint read"],
        "resharded load / same-mesh load (target <= 1.2)":
            med["tfdist load (resharded)"] / med["tfdist load (same mesh)"],
        "async_save blocking / save (target < 0.10)": med["tfdist async_save (blocking)"] / med["tfdist save"],
        "async_save PROCESS blocking / save": med["tfdist async_save PROCESS (blocking)"] / med["tfdist save"],
        "async_save total: PROCESS / THREAD": med["tfdist async_save PROCESS (total)"]
        / med["tfdist async_save (total)"],
        "train step during THREAD save / no save": med["train step during THREAD async_save"]
        / med["train step, no save"],
        "train step during PROCESS save / no save": med["train step during PROCESS async_save"]
        / med["train step, no save"],
    }
    print(f"state: {megabytes:.1f} MB, {ROUNDS} rounds, median")
    print_table(rows, ["program", "median_s", "MB/s"])
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    path = write_results("checkpoint", rows, {"state_mb": megabytes, "rounds": ROUNDS,
                                              "ratios": {k: round(v, 3) for k, v in ratios.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
