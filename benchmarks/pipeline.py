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
  the peak of TF's CPU allocator during a step above what it held before
  (``tf.config.experimental.get_memory_info``; batch 4096, GPipe and 1F1B,
  8 microbatches): what the kept activations cost.
* Profiler trace: one more step of each schedule under the TF profiler
  (tfdist.pipelining.read_profile): ranks busy at once on average, and the
  share of kernel time with two or more kernels running at once; the 1F1B
  trace is drawn into docs/images/pipeline_1f1b_profile.png.
* Across clients (``--clients``, run by ``tfdist run --nproc-per-node 4
  --devices-per-proc 2``): pp = 2 stage groups, each a (dp, tp) = 2 x 2
  sub-mesh spanning 2 clients, TP (colwise, rowwise) x FSDP inside each
  stage, GPipe and 1F1B with 8 microbatches. Bytes each client sends across
  the stage boundary per step, shard-wise (what tfdist does between
  congruent sub-meshes) against the whole-tensor transfer it falls back to
  otherwise, and against torch's isend/irecv volume for the same layout (8
  ranks, each sending its dp shard); step times in interleaved rounds,
  losses checked equal. The 1F1B run's timeline, every client's actions on
  its own clock, is drawn into docs/images/pipeline_3d_executed.png.

    python benchmarks/pipeline.py        # writes benchmarks/results/pipeline.json
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import tfdist  # noqa: E402

CLIENTS = sys.argv[1:2] == ["--clients"]
if not CLIENTS:  # tfdist run gives each client process its devices
    tfdist.virtual_cpus(8)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from _common import RESULTS, print_table, write_results  # noqa: E402
from tfdist.pipelining import (  # noqa: E402
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, plot_schedule,
    read_profile,
)
from tfdist.pipelining import _orders, _timeline  # noqa: E402
from tfdist.pipelining._actions import B, F, I, REDUCE_GRAD, W  # noqa: E402

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


def interleaved_ms(run, keys: list) -> dict:
    """``ROUNDS`` rounds, each timing ``run(key)`` once per key in turn: milliseconds per key."""
    samples = {k: [] for k in keys}
    for _ in range(ROUNDS):
        for k in keys:
            t0 = time.perf_counter()
            run(k)
            samples[k].append((time.perf_counter() - t0) * 1e3)
    return samples


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


def layer_stages(rank_of) -> list[PipelineStage]:
    """The same 8 Dense layers as ``blocks``, one per stage, 2 stages per rank (``rank_of(stage)``),
    each rank on CPU:0/2/4/6."""
    layers = [layer for block in blocks() for layer in block.layers]
    return [PipelineStage(keras.Sequential([keras.Input((512,)), layer]), i, 2 * P, f"CPU:{2 * rank_of(i)}")
            for i, layer in enumerate(layers)]


def measured_costs(executed: dict) -> dict:
    """Median duration of each (stage, computation type) in a recorded step: the stages' real costs."""
    durations: dict = {}
    for acts in executed.values():
        for action, start, end in acts:
            found = re.fullmatch(r"(\d+)([A-Z_]+)(\d*)", action)
            if found:  # an OVERLAP_F_B pair has no single stage
                durations.setdefault((int(found[1]), found[2]), []).append(end - start)
    kinds = {"F": F, "B": B, "I": I, "W": W, "REDUCE_GRAD": REDUCE_GRAD}
    return {(s, kinds[k]): statistics.median(d) for (s, k), d in durations.items() if k in kinds}


def executed_bubble_rows(x, y) -> list[dict]:
    """Each schedule's executed bubble in a real step (median of 3 after a warm-up) at m = 4, 8, 16,
    against its plan's bubble with unit costs (for GPipe and 1F1B, the formula (p-1)/(m+p-1)) and with
    the costs each stage's actions took in that step (first and last stages do less and more than the
    others: no input gradient, the loss)."""
    plans = {(b["schedule"].split(" ")[0], b["m"]): b["bubble"] for b in plan_bubbles()}
    kinds = (("GPipe", ScheduleGPipe, None), ("1F1B", Schedule1F1B, None),
             ("Interleaved1F1B", ScheduleInterleaved1F1B, lambda i: i % P),
             ("ZBVZeroBubble", ScheduleZBVZeroBubble, lambda i: i if i < P else 2 * P - 1 - i))
    rows = []
    for m in (4, 8, 16):
        for name, cls, rank_of in kinds:
            stages = stages_of(False) if rank_of is None else layer_stages(rank_of)
            pipe = cls(stages, m, loss_fn=mse)
            fractions = []
            for _ in range(4):
                for s in stages:
                    s.zero_grads()
                pipe.step(x, target=y)
                stages[0].grads[0].numpy()
                fractions.append(executed_bubble(pipe.executed_order))
            executed, plan = statistics.median(fractions[1:]), plans[(name, m)]
            costed = _timeline.bubble_fraction(_timeline.simulate(
                pipe._execution_order(), len(stages), measured_costs(pipe.executed_order)))
            rows.append({"schedule": name, "m": m, "executed bubble": round(executed, 3), "plan bubble": plan,
                         "executed - plan": round(executed - plan, 3),
                         "plan bubble, measured costs": round(costed, 3),
                         "executed - plan, measured costs": round(executed - costed, 3)})
    return rows


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


def allocated_rise_during(run) -> int:
    """Bytes TF's CPU allocator held at its peak during ``run()`` above what it held before (every
    virtual CPU device allocates from the one host allocator, so this is the whole step's)."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    run()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base


def memory_worker(schedule: str, checkpoint: bool) -> None:
    """One process, one mode: the peak memory a step adds (median of 3 after a warm-up)."""
    batch = 4096
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 512)).astype("float32")
    y = rng.standard_normal((batch, 512)).astype("float32")
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    pipe = cls(stages_of(checkpoint), 8, loss_fn=mse)
    pipe.step(x, target=y)
    rises = [allocated_rise_during(lambda: pipe.step(x, target=y)) for _ in range(3)]
    print(json.dumps({"peak_rise_mb": round(statistics.median(rises) / 2**20, 1)}))


def memory_rows() -> list[dict]:
    rows = []
    for schedule in ("GPipe", "1F1B"):
        for checkpoint in (False, True):
            out = subprocess.run([sys.executable, __file__, "--memory", schedule, str(int(checkpoint))],
                                 capture_output=True, text=True, check=True)
            rise = json.loads(out.stdout.strip().splitlines()[-1])["peak_rise_mb"]
            rows.append({"schedule": schedule, "activations": "recomputed" if checkpoint else "kept",
                         "peak memory a step adds (MB)": rise})
    return rows


def images_dir() -> str:
    """Where the pictures docs/pipelining.md shows go: docs/images, or beside the results of a
    run_all.py --quick run (which never overwrites what is committed)."""
    images = os.path.join(os.path.dirname(__file__), "..", "docs", "images") \
        if os.environ.get("TFDIST_BENCH_RESULTS") is None else str(RESULTS)
    os.makedirs(images, exist_ok=True)
    return images


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
        plot_schedule(pipe, os.path.join(images_dir(), "pipeline_1f1b_profile.png"), profile=profile)
    return {"profiled ranks busy at once": round(profile.concurrency(), 2),
            "profiled kernel overlap": round(profile.kernel_overlap(), 2)}


def clients_worker() -> None:
    """One client of the 4-client 3-D run: prints its rows (bytes, step times, losses) and its
    executed 1F1B timeline as one JSON line."""
    from tfdist.device_mesh import DeviceMesh
    from tfdist.fsdp import fully_shard
    from tfdist.pipelining import schedules
    from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tfdist.init_process_group()
    rank, batch, hidden, m = tfdist.get_rank(), 256, 512, 8
    subs = [DeviceMesh("cpu", [[4 * g, 4 * g + 1], [4 * g + 2, 4 * g + 3]], mesh_dim_names=("dp", "tp"))
            for g in range(2)]
    g = rank // 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, hidden)).astype("float32")
    y = rng.standard_normal((batch, hidden)).astype("float32")
    pipes = {}
    for name, cls in (("GPipe", ScheduleGPipe), ("1F1B", Schedule1F1B)):
        for mode in ("shard-wise", "whole tensor"):
            keras.utils.set_random_seed(g)
            part = keras.Sequential([keras.Input((hidden,)), keras.layers.Dense(hidden, activation="tanh", name="up"),
                                     keras.layers.Dense(hidden, name="down")])
            parallelize_module(part, subs[g]["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(part, mesh=subs[g]["dp"])
            stage = PipelineStage(part, g, 2, subs[g])
            pipe = cls([stage], m, loss_fn=mse)
            congruent = schedules._congruent
            if mode == "whole tensor":  # what a pair of incongruent sub-meshes carries
                schedules._congruent = lambda *a: False
            pipe._channel_list()
            schedules._congruent = congruent
            pipes[(name, mode)] = (pipe, stage)

    def run(key):
        pipe, stage = pipes[key]
        stage.zero_grads()
        losses = []
        pipe.step(*((x,) if g == 0 else ()), target=y if g == 1 else None, losses=losses)
        tf.convert_to_tensor(stage.grads[0])  # the step's last gradient is made
        return float(np.mean([float(tf.reduce_mean(l)) for l in losses])) if g == 1 else None

    first = {k: run(k) for k in pipes}
    sent_before = {k: sum(ch.bytes_sent for ch, _, _ in pipes[k][0]._channel_list()) for k in pipes}
    samples = interleaved_ms(run, list(pipes))
    # torch: each of a stage's 4 ranks sends its dp shard of every microbatch (batch/m/dp rows) to its peer
    torch_per_rank = batch // 2 * hidden * 4
    rows = [{"schedule": k[0], "boundary transfer": k[1], "client": rank,
             "bytes sent per step": (sum(ch.bytes_sent for ch, _, _ in pipes[k][0]._channel_list())
                                     - sent_before[k]) // ROUNDS,
             "torch bytes per step (the client's 2 ranks)": 2 * torch_per_rank,
             "step_ms": round(statistics.median(samples[k]), 1), "loss": first[k]} for k in pipes]
    timeline = pipes[("1F1B", "shard-wise")][0].executed_order
    print("RESULT " + json.dumps({"rows": rows, "timeline": timeline}), flush=True)


def client_rows() -> list[dict]:
    """Runs ``clients_worker`` on 4 clients x 2 devices; one row per schedule and transfer (client 0's
    step time, bytes per client), and the 3-D timeline picture."""
    out = subprocess.run([sys.executable, "-m", "tfdist.run", "--nproc-per-node", "4", "--devices-per-proc", "2",
                          "--master-port", os.environ.get("MASTER_PORT", "29760"), __file__, "--clients"],
                         capture_output=True, text=True, timeout=1800)
    results = {}
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            got = json.loads(line.split("RESULT ", 1)[1])
            results[got["rows"][0]["client"]] = got
    if out.returncode != 0 or len(results) != 4:
        raise RuntimeError(f"the 4-client run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    losses = {(r["schedule"], r["boundary transfer"]): r["loss"] for r in results[2]["rows"]}
    assert len({round(v, 6) for v in losses.values()}) == 1, losses  # every mode computes the same step
    rows = []
    for i, r in enumerate(results[0]["rows"]):
        sent = [results[c]["rows"][i]["bytes sent per step"] for c in range(4)]
        rows.append({"schedule": r["schedule"], "boundary transfer": r["boundary transfer"],
                     "step_ms (client 0)": r["step_ms"], "bytes per client per step": sent[0],
                     "all clients' bytes per step": sum(sent),
                     "torch's bytes per step": 4 * r["torch bytes per step (the client's 2 ranks)"],
                     "vs torch": round(sum(sent) / (4 * r["torch bytes per step (the client's 2 ranks)"]), 2),
                     "loss": round(losses[(r["schedule"], r["boundary transfer"])], 6)})
    # one row per pipeline rank: client 0 ran rank 0, client 2 rank 1 (each on its own clock)
    lines = {0: results[0]["timeline"]["0"], 1: results[2]["timeline"]["1"]}
    draw_clients_timeline(lines)
    return rows


def draw_clients_timeline(lines: dict) -> None:
    """The 3-D 1F1B run's executed actions, as plot_schedule draws a schedule's."""
    class Recorded:  # what plot_schedule reads of a schedule
        executed_order = {r: [tuple(a) for a in acts] for r, acts in lines.items()}
        _n_microbatches = 8

    Recorded.__name__ = "Schedule1F1B across 4 clients, pp = 2 x (dp 2 x tp 2)"
    plot_schedule(Recorded(), os.path.join(images_dir(), "pipeline_3d_executed.png"), executed=True)


def main() -> None:
    clients = client_rows()
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
    samples = interleaved_ms(run, names)
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
    executed_bubbles = executed_bubble_rows(x, y)
    print("bubble fraction of each plan (unit costs)")
    print_table(bubbles, ["schedule", "p", "m", "bubble", "theory (p-1)/(m+p-1)"])
    print(f"\nstep time, 8 microbatches, {ROUNDS} rounds, median (loss {first['one device']:.5f} in all)")
    print_table(steps, ["program", "step_ms", "vs one device", "compute vs one device", "inputs held per stage",
                        "executed bubble", "profiled ranks busy at once", "profiled kernel overlap"])
    print("\nexecuted bubble of a real step (p = 4; 2 stages per rank for the multi-stage plans), median of 3")
    print_table(executed_bubbles, ["schedule", "m", "executed bubble", "plan bubble", "executed - plan",
                                   "plan bubble, measured costs", "executed - plan, measured costs"])
    print("\npeak memory a step adds (TF's allocator; batch 4096, 8 microbatches, a process per row)")
    print_table(memory, ["schedule", "activations", "peak memory a step adds (MB)"])
    print("\nacross 4 clients: pp = 2 x (dp 2 x tp 2), batch 256 x 512 float32, 8 microbatches")
    print_table(clients, ["schedule", "boundary transfer", "step_ms (client 0)", "bytes per client per step",
                          "all clients' bytes per step", "torch's bytes per step", "vs torch", "loss"])
    path = write_results("pipeline", steps, {"bubbles": bubbles, "rounds": ROUNDS, "memory": memory,
                                             "executed bubbles": executed_bubbles, "across clients": clients})
    print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory"]:
        memory_worker(sys.argv[2], bool(int(sys.argv[3])))
    elif CLIENTS:
        clients_worker()
    else:
        main()
