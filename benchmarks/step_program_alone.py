"""Each step program alone, in fresh processes: is a gap between ``fit`` and the hand-written
loop in the program or in the loop around it?

    python benchmarks/step_program_alone.py [--workload W2] [--rounds 4] [--steps 50]

Programs (one per fresh process, the order rotating every round; 8 virtual CPUs, 2x4 mesh):

- ``parallelize``: the step ``fit`` traces after ``parallelize_module`` (W2: ``parallelize_gpt``);
- ``layout_map``: the step ``fit`` traces under a ``keras.distribution`` LayoutMap;
- ``hand_written``: the hand-written TF DTensor step of ``compare.py`` (``_handwritten.py``).

Each process places one batch, then runs three blocks of ``--steps`` calls of the program
on it (no feeding, no Keras loop), reading the loss only at the ends of a block, and reports
the wall ms per step, the process CPU ms per step (all threads, ``getrusage``) and the
voluntary context switches per step.  Writes ``results/step_program_alone_<W>.json`` and
prints medians and the ratios to the hand-written program.

    python benchmarks/step_program_alone.py --alternate [--workload W2] [--chunks 40] [--steps 5]

holds ``parallelize`` and ``hand_written`` in one process and alternates chunks of
``--steps`` calls of each (the order flipping every chunk), each chunk ending in a read of
its loss: a slow spell of the host (this 2-core VM has them, seconds to minutes long) then
lands on both programs alike, where fresh processes minutes apart see different hosts.
Writes ``results/step_program_alone_<W>_alternating.json``: per-chunk wall and CPU ms per
step, the median of the chunk-pair ratios and the ratio of the sums.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import sys
from _common import RESULTS  # noqa: E402  (the results folder; run_all.py --quick moves it)

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = ("parallelize", "layout_map", "hand_written")


def _tfdist_step(program: str, w: dict, x, y):
    """The traced one-step program ``fit`` runs on one placed batch (``program``: ``parallelize``,
    ``layout_map`` or ``data_parallel`` on 8), as a call."""
    import keras
    import tensorflow as tf

    import compare
    import tfdist

    tfdist.virtual_cpus(8)
    import tfdist.keras  # noqa: F401
    from tfdist.keras import _data
    from tfdist.keras._trainer import mesh_of
    from tfdist.models import parallelize_gpt
    from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if program == "data_parallel":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = compare._keras_model(keras, w)
    elif program == "layout_map":
        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
        layout_map = keras.distribution.LayoutMap(mesh)
        rules = ({".*/up/kernel": (None, "model"), ".*/up/bias": ("model",), ".*/down/kernel": ("model", None)}
                 if w["kind"] == "mlp" else compare._gpt_layout_map())
        for key, axes in rules.items():
            layout_map[key] = axes
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
        model = compare._keras_model(keras, w)
    else:
        model = compare._keras_model(keras, w)
        mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        if w["kind"] == "mlp":
            parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        else:
            parallelize_gpt(model, mesh)
    b = w["batch"]
    model.compile(optimizer=keras.optimizers.Adam(w["lr"]), loss=compare._loss(keras, w))
    model.fit(x[:2 * b], y[:2 * b], batch_size=b, epochs=1, verbose=0, shuffle=False)
    tf_mesh, batch_axis = mesh_of(model)
    data = _data.shard_batch((tf.constant(x[:b]), tf.constant(y[:b])), tf_mesh, batch_axis)
    program_fn = model.train_function.one_step.traced[0].get_concrete_function(data)

    def run():
        return program_fn(data)

    run.program = program_fn  # the concrete program, for inspection (benchmarks/loss_reduction.py)
    return run


def _hand_step(w: dict, x, y):
    import keras
    from tensorflow.experimental import dtensor

    import _handwritten
    import compare

    compare._virtual_cpus(8)
    mesh = dtensor.create_mesh([("dp", 2), ("tp", 4)], devices=[f"CPU:{i}" for i in range(8)])
    step = _handwritten.train_step(compare._keras_model(keras, w), mesh, w)

    batch = tuple(_handwritten.place_by_dp(t[:w["batch"]], mesh) for t in (x, y))
    return lambda: step(*batch)


def worker(program: str, workload: str, steps: int) -> None:
    import resource

    sys.path.insert(0, HERE)
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    import compare

    w = compare.WORKLOADS[workload]
    x, y = compare._data(w)
    run = _hand_step(w, x, y) if program == "hand_written" else _tfdist_step(program, w, x, y)

    def read(out) -> float:
        return float(dtensor.unpack(tf.nest.flatten(out)[0])[0])

    def block() -> dict:
        read(run())
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for _ in range(steps):
            out = run()
        read(out)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return {"wall_ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3,
                "voluntary_switches": (after.ru_nvcsw - before.ru_nvcsw) / steps}

    blocks = [block() for _ in range(3)]
    print("RESULT " + json.dumps({k: statistics.median(b[k] for b in blocks) for k in blocks[0]}), flush=True)


def alternate(workload: str, chunks: int, steps: int) -> dict:
    """``parallelize`` and ``hand_written`` in this process, in alternating chunks of ``steps`` calls."""
    sys.path.insert(0, HERE)
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    import compare

    w = compare.WORKLOADS[workload]
    x, y = compare._data(w)
    programs = {"hand_written": _hand_step(w, x, y), "parallelize": _tfdist_step("parallelize", w, x, y)}

    def chunk(run) -> tuple[float, float]:
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(steps):
            out = run()
        float(dtensor.unpack(tf.nest.flatten(out)[0])[0])
        return (time.perf_counter() - start) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3

    for run in programs.values():  # warm-up
        chunk(run)
    times: dict = {p: [] for p in programs}
    for i in range(chunks):
        for p in (list(programs) if i % 2 == 0 else list(programs)[::-1]):
            times[p].append(chunk(programs[p]))
    par, hand = np.array(times["parallelize"]), np.array(times["hand_written"])
    ratios = {k: {"median of chunk pairs": float(np.median(par[:, j] / hand[:, j])),
                  "ratio of sums": float(par[:, j].sum() / hand[:, j].sum())}
              for j, k in enumerate(("wall_ms", "cpu_ms"))}
    summary = {p: {"wall_ms": float(np.median(np.array(t)[:, 0])), "cpu_ms": float(np.median(np.array(t)[:, 1]))}
               for p, t in times.items()}
    chunks_ms = {p: [[round(a, 3), round(b, 3)] for a, b in t] for p, t in times.items()}
    return {"summary": summary, "parallelize/hand_written": ratios, "chunks": chunks_ms}


def main_alternate(args) -> None:
    out = alternate(args.workload, args.chunks, args.steps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    out = {"command": "python benchmarks/step_program_alone.py " + " ".join(sys.argv[1:]), "commit": commit,
           "workload": args.workload, "chunks": args.chunks, "steps per chunk": args.steps, **out}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"step_program_alone_{args.workload}_alternating.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n| {args.workload} program, one process | wall ms/step | CPU ms/step |")
    print("| --- | --- | --- |")
    for p, s in out["summary"].items():
        print(f"| {p} | {s['wall_ms']:.1f} | {s['cpu_ms']:.1f} |")
    for k, r in out["parallelize/hand_written"].items():
        print(f"parallelize / hand_written {k}: {r['median of chunk pairs']:.3f} (median of chunk pairs), "
              f"{r['ratio of sums']:.3f} (ratio of sums)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W2", choices=["W1", "W2"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="steps per block (50) or per chunk (5)")
    parser.add_argument("--alternate", action="store_true", help="parallelize and hand_written in one process")
    parser.add_argument("--chunks", type=int, default=40)
    args = parser.parse_args()
    if args.alternate:
        args.steps = args.steps or 5
        return main_alternate(args)
    args.steps = args.steps or 50
    runs: dict = {p: [] for p in PROGRAMS}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for r in range(args.rounds):
        for program in PROGRAMS[r % len(PROGRAMS):] + PROGRAMS[:r % len(PROGRAMS)]:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", program,
                                   args.workload, str(args.steps)], capture_output=True, text=True, env=env, timeout=900)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                raise RuntimeError(f"{program} failed: {proc.stderr.strip().splitlines()[-3:]}")
            runs[program].append(json.loads(lines[-1][len("RESULT "):]))
            row = runs[program][-1]
            print(f"round {r + 1}/{args.rounds} {program:<13} {row['wall_ms']:.1f} ms wall  "
                  f"{row['cpu_ms']:.1f} ms CPU  {row['voluntary_switches']:.0f} switches", flush=True)
    summary = {p: {k: statistics.median(run[k] for run in runs[p]) for k in runs[p][0]} for p in PROGRAMS}
    ratios = {f"{p}/hand_written": {k: statistics.median(a[k] / h[k] for a, h in zip(runs[p], runs["hand_written"]))
                                    for k in ("wall_ms", "cpu_ms")} for p in PROGRAMS[:2]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    out = {"command": "python benchmarks/step_program_alone.py " + " ".join(sys.argv[1:]), "commit": commit,
           "workload": args.workload, "rounds": args.rounds, "steps": args.steps,
           "summary": summary, "ratios (median of per-round ratios)": ratios, "runs": runs}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"step_program_alone_{args.workload}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n| {args.workload} program | wall ms/step | CPU ms/step | voluntary switches/step | wall / hand | CPU / hand |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in PROGRAMS:
        s, q = summary[p], ratios.get(f"{p}/hand_written", {"wall_ms": 1.0, "cpu_ms": 1.0})
        print(f"| {p} | {s['wall_ms']:.1f} | {s['cpu_ms']:.1f} | {s['voluntary_switches']:.0f} | "
              f"{q['wall_ms']:.3f} | {q['cpu_ms']:.3f} |")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
