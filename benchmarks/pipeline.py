"""Pipeline schedules on 8 virtual CPUs: bubble fraction of each plan, microbatch inputs held, step time.

* Bubble fraction: each schedule's plan (p = 4 pipeline ranks, m = 4, 8, 16
  microbatches) timed with forward = 1, backward-input = 1, backward-weight = 1,
  full backward = 2 units (tfdist.pipelining._timeline.simulate: every rank
  runs its plan in order, an action starts once its inputs exist), against
  the GPipe/1F1B formula (p - 1) / (m + p - 1).
* Inputs held: the most microbatch inputs a stage kept at once during a real
  step (what a stage holds between its forward and backward), GPipe vs 1F1B.
* Step time: 4 blocks of Dense(512, tanh) -> Dense(512), batch 512, one stage
  per block on CPU:0/2/4/6, GPipe and 1F1B with 8 microbatches, against the
  same model's train step on one device; interleaved rounds, median; losses
  checked equal.  Each pipeline rank runs in its own thread; the executed
  bubble is the idle share of the ranks in the recorded trace (8 virtual
  CPUs share 2 cores here, so at most 2 stages truly run at once).
* Recomputation: the same steps with ``activation_checkpoint=True`` stages
  (each backward runs its stage's forward again); per program, the MatMul
  kernels the TF profiler saw in one step, weighed by their rows (a
  microbatch has 1/8 of the batch), against one device's step on the whole
  batch (every matmul of this model is rows x 512 x 512, so that ratio is
  the ratio of FLOPs); and, in a process of its own per mode (``--memory``),
  how far the process's resident memory rises above its level before a
  step while the step runs (sampled every millisecond; batch 4096, GPipe
  and 1F1B, 8 microbatches): what the kept activations cost.
* Profiler trace: one more step of each schedule under the TF profiler
  (tfdist.pipelining.read_profile): ranks busy at once on average, and the
  share of kernel time with two or more kernels running at once; the 1F1B
  trace is drawn into docs/images/pipeline_1f1b_profile.png.

    python benchmarks/pipeline.py        # writes benchmarks/results/pipeline.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

tfdist.virtual_cpus(8)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from _common import RESULTS, print_table, write_results  # noqa: E402
from tfdist.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, plot_schedule, read_profile  # noqa: E402
from tfdist.pipelining import _orders, _timeline  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
BATCH = int(os.environ.get("BATCH", "512"))
P = 4


def plan_bubbles() -> list[dict]:
    rows = []
    for m in (4, 8, 16):
        plans = {
            "GPipe": ({r: _orders.gpipe(r, P, m) for r in range(P)}, P),
            "1F1B": ({r: _orders.one_f_one_b_execution(r, P, m) for r in range(P)}, P),
            "Interleaved1F1B (2/rank)": ({r: _orders.interleaved_1f1b(r, P, 2, m) for r in range(P)}, 2 * P),
            "LoopedBFS (2/rank)": ({r: _orders.looped_bfs(r, P, 2, m) for r in range(P)}, 2 * P),
            "InterleavedZeroBubble (2/rank)": (_orders.interleaved_zero_bubble(P, 2, m), 2 * P),
            "ZBVZeroBubble (2/rank)": ({r: _orders.zbv(r, P, m) for r in range(P)}, 2 * P),
        }
        if m >= 2 * P:
            plans["DualPipeV (2/rank)"] = ({r: _orders.dualpipe_v(r, P, m) for r in range(P)}, 2 * P)
        for name, (order, stages) in plans.items():
            frac = _timeline.bubble_fraction(_timeline.simulate(order, stages))
            rows.append({"schedule": name, "p": P, "m": m, "bubble": round(frac, 3),
                         "theory (p-1)/(m+p-1)": round((P - 1) / (m + P - 1), 3)})
    return rows


def executed_bubble(executed: dict) -> float:
    """Idle share of the ranks between the first start and the last end of a real step's trace."""
    start = min(t for acts in executed.values() for _, t, _ in acts)
    end = max(e for acts in executed.values() for _, _, e in acts)
    busy = sum(e - t for acts in executed.values() for _, t, e in acts)
    return 1.0 - busy / ((end - start) * len(executed))


def blocks(seed=0):
    keras.utils.set_random_seed(seed)
    return [keras.Sequential([keras.Input((512,)), keras.layers.Dense(512, activation="tanh"),
                              keras.layers.Dense(512)]) for _ in range(P)]


def mse(y, t):
    return tf.reduce_mean((y - t) ** 2)


def stages_of(checkpoint: bool) -> list[PipelineStage]:
    return [PipelineStage(b, i, P, f"CPU:{2 * i}", activation_checkpoint=checkpoint) for i, b in enumerate(blocks())]


def matmul_rows(run, rows: int) -> int:
    """MatMul kernels the TF profiler saw during ``run()``, times ``rows`` (the rows each multiplies)."""
    logdir = tempfile.mkdtemp(prefix="tfdist-pp-flops-")
    tf.profiler.experimental.start(logdir)
    try:
        with tf.profiler.experimental.Trace("step", pipeline_rank=0):  # read_profile wants an action
            run()
    finally:
        tf.profiler.experimental.stop()
    return rows * sum(1 for _, name, _, _ in read_profile(logdir).kernels if name.endswith("MatMul"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_rise_during(run) -> int:
    """Bytes the resident set rose above its level before ``run()`` while it ran (1 ms samples)."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        run()
    finally:
        done.set()
        watcher.join()
    return max(peak[0], _rss()) - base


def memory_worker(schedule: str, checkpoint: bool) -> None:
    """One process, one mode: the resident-memory rise of a step (median of 3 after a warm-up)."""
    batch = 4096
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 512)).astype("float32")
    y = rng.standard_normal((batch, 512)).astype("float32")
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    pipe = cls(stages_of(checkpoint), 8, loss_fn=mse)
    pipe.step(x, target=y)
    rises = [rss_rise_during(lambda: pipe.step(x, target=y)) for _ in range(3)]
    print(json.dumps({"rss_rise_mb": round(statistics.median(rises) / 2**20, 1)}))


def memory_rows() -> list[dict]:
    rows = []
    for schedule in ("GPipe", "1F1B"):
        for checkpoint in (False, True):
            out = subprocess.run([sys.executable, __file__, "--memory", schedule, str(int(checkpoint))],
                                 capture_output=True, text=True, check=True)
            rise = json.loads(out.stdout.strip().splitlines()[-1])["rss_rise_mb"]
            rows.append({"schedule": schedule, "activations": "recomputed" if checkpoint else "kept",
                         "memory rise during a step (MB)": rise})
    return rows


def profile_step(pipe, x, y, name: str) -> dict:
    """One step under the TF profiler: how many ranks were busy at once, and how often kernels overlapped."""
    logdir = tempfile.mkdtemp(prefix=f"tfdist-pp-{name}-")
    tf.profiler.experimental.start(logdir)
    try:
        pipe.step(x, target=y)
    finally:
        tf.profiler.experimental.stop()
    profile = read_profile(logdir)
    if name == "1F1B":
        # the picture docs/pipelining.md shows; a run_all.py --quick run keeps it beside its results
        images = os.path.join(os.path.dirname(__file__), "..", "docs", "images") \
            if os.environ.get("TFDIST_BENCH_RESULTS") is None else str(RESULTS)
        plot_schedule(pipe, os.path.join(images, "pipeline_1f1b_profile.png"), profile=profile)
    return {"profiled ranks busy at once": round(profile.concurrency(), 2),
            "profiled kernel overlap": round(profile.kernel_overlap(), 2)}


def main() -> None:
    bubbles = plan_bubbles()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 512)).astype("float32")
    y = rng.standard_normal((BATCH, 512)).astype("float32")
    whole = keras.Sequential([keras.Input((512,))] + blocks())

    @tf.function
    def one_device_step(x, y):
        with tf.GradientTape() as tape:
            loss = mse(whole(x), y)
        return loss, tape.gradient(loss, whole.trainable_variables)

    pipes = {}
    for name, cls in [("GPipe", ScheduleGPipe), ("1F1B", Schedule1F1B)]:
        for suffix, checkpoint in (("", False), (" (recompute)", True)):
            stages = stages_of(checkpoint)
            pipes[name + suffix] = (cls(stages, 8, loss_fn=mse), stages)

    def run(name):
        if name == "one device":
            loss, grads = one_device_step(x, y)
            grads[-1].numpy()
            return float(loss)
        pipe, stages = pipes[name]
        for s in stages:
            s.zero_grads()
        losses = []
        pipe.step(x, target=y, losses=losses)
        stages[0].grads[0].numpy()
        return float(np.mean([l.numpy() for l in losses]))

    names = ["one device", "GPipe", "GPipe (recompute)", "1F1B", "1F1B (recompute)"]
    first = {n: run(n) for n in names}  # warm-up (traces) and the loss check
    assert max(first.values()) - min(first.values()) < 1e-5 * abs(first["one device"]), first
    samples = {n: [] for n in names}
    for _ in range(ROUNDS):
        for n in names:
            t0 = time.perf_counter()
            run(n)
            samples[n].append((time.perf_counter() - t0) * 1e3)
    held = {n: [s.peak_held_inputs for s in pipes[n][1]] for n in ("GPipe", "1F1B")}
    flops = {n: matmul_rows(lambda n=n: run(n), BATCH if n == "one device" else BATCH // 8) for n in names}
    profiled = {n: profile_step(pipes[n][0], x, y, n) for n in ("GPipe", "1F1B")}
    executed = {n: round(executed_bubble(pipes[n][0].executed_order), 3) for n in ("GPipe", "1F1B")}
    steps = [{"program": n, "step_ms": round(statistics.median(samples[n]), 1),
              "vs one device": round(statistics.median(samples[n]) / statistics.median(samples["one device"]), 2),
              "compute vs one device": round(flops[n] / flops["one device"], 2),
              "inputs held per stage": held.get(n, ""), "executed bubble": executed.get(n, ""),
              **profiled.get(n, {})} for n in names]
    memory = memory_rows()
    print("bubble fraction of each plan (unit costs)")
    print_table(bubbles, ["schedule", "p", "m", "bubble", "theory (p-1)/(m+p-1)"])
    print(f"\nstep time, 8 microbatches, {ROUNDS} rounds, median (loss {first['one device']:.5f} in all)")
    print_table(steps, ["program", "step_ms", "vs one device", "compute vs one device", "inputs held per stage",
                        "executed bubble", "profiled ranks busy at once", "profiled kernel overlap"])
    print("\nmemory a step adds (batch 4096, 8 microbatches, a process per row)")
    print_table(memory, ["schedule", "activations", "memory rise during a step (MB)"])
    path = write_results("pipeline", steps, {"bubbles": bubbles, "rounds": ROUNDS, "memory": memory})
    print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory"]:
        memory_worker(sys.argv[2], bool(int(sys.argv[3])))
    else:
        main()
