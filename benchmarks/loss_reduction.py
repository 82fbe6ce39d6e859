"""Keras' mean loss inside the step ``fit`` traces: Keras' own ``sum / size`` against tfdist's one
``tf.reduce_mean`` (``tfdist/keras/_loss_reduction.py``), same process, same weights.

    python benchmarks/loss_reduction.py [--rounds 8] [--steps 20]

Keras' sum is an ``Add`` all-reduce of one float that TF DTensor's combiner packs first into
the gradients' buffer, so every gradient after it is sliced out off a 64-byte boundary, which
TF copies.  For each setting (W1 ``DataParallel`` on 8, W1 ``parallelize_module`` on 2x4, W2
``parallelize_gpt`` on 2x4; compare.py's workloads, Adam), a fresh process traces the step
both ways, reads from what TF ran the bytes of the gradients sliced out unaligned, checks
that both programs give the same losses, and times them in alternating blocks of ``--steps``
steps (the order flips every round).  Writes ``results/loss_reduction.json`` and prints a table
with the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from _common import RESULTS  # noqa: E402  (the results folder; run_all.py --quick moves it)

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {"W1 data parallel 8": ("W1", "data_parallel"), "W1 parallelize_module 2x4": ("W1", "parallelize"),
            "W2 parallelize_gpt 2x4": ("W2", "parallelize")}


def _traced_both_ways(workload: str, program: str):
    """(Keras' sum, tfdist's mean): the step program traced with each loss reduction."""
    import compare
    import step_program_alone

    w = compare.WORKLOADS[workload]
    x, y = compare._data(w)
    import tfdist

    tfdist.virtual_cpus(8)
    from tfdist.keras import _trainer
    from tfdist.tensor.parallel.loss import loss_parallel

    def keras_sum():  # what the step is traced in (_trainer._tracing_scope), minus the mean reduction
        return loss_parallel()

    tfdist_scope = _trainer._tracing_scope
    _trainer._tracing_scope = keras_sum
    try:
        keras_run = step_program_alone._tfdist_step(program, w, x, y)
    finally:
        _trainer._tracing_scope = tfdist_scope
    return keras_run, step_program_alone._tfdist_step(program, w, x, y)


def worker(setting: str, rounds: int, steps: int) -> None:
    sys.path.insert(0, HERE)
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    runs = dict(zip(("keras_sum", "tfdist_mean"), _traced_both_ways(*SETTINGS[setting])))
    from tfdist.tensor.debug._executed import combined_all_reduce_pieces

    def read(out) -> float:
        return float(dtensor.unpack(tf.nest.flatten(out)[0])[0])

    first = {name: read(run()) for name, run in runs.items()}
    unaligned = {name: sum(4 * size for _, offset, size in combined_all_reduce_pieces(run.program) if offset % 16)
                 for name, run in runs.items()}

    def block(run) -> float:
        read(run())
        start = time.perf_counter()
        for _ in range(steps):
            out = run()
        read(out)
        return (time.perf_counter() - start) / steps * 1e3

    ms: dict = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            ms[name].append(block(runs[name]))
    last = {name: read(run()) for name, run in runs.items()}  # both took the same steps
    print("RESULT " + json.dumps({"first_loss": first, "last_loss": last, "unaligned_bytes_per_device": unaligned,
                                  "ms": ms}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    results = {}
    for setting in SETTINGS:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", setting, str(args.rounds),
                               str(args.steps)], capture_output=True, text=True, env=env, timeout=1800)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"{setting} failed: {proc.stderr.strip().splitlines()[-3:]}")
        r = json.loads(lines[-1][len("RESULT "):])
        for when, rtol in (("first_loss", 1e-5), ("last_loss", 1e-3)):  # float32 sums in another order
            a, b = r[when]["keras_sum"], r[when]["tfdist_mean"]
            if abs(a - b) > rtol * abs(a):
                raise RuntimeError(f"{setting}: {when} differs, Keras' sum {a} against tfdist's mean {b}")
        r["ratio tfdist_mean/keras_sum (median of per-round ratios)"] = statistics.median(
            b / a for a, b in zip(r["ms"]["keras_sum"], r["ms"]["tfdist_mean"]))
        r["range"] = [min(b / a for a, b in zip(r["ms"]["keras_sum"], r["ms"]["tfdist_mean"])),
                      max(b / a for a, b in zip(r["ms"]["keras_sum"], r["ms"]["tfdist_mean"]))]
        results[setting] = r
        print(f"{setting}: {statistics.median(r['ms']['keras_sum']):.1f} -> "
              f"{statistics.median(r['ms']['tfdist_mean']):.1f} ms", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    out = {"command": "python benchmarks/loss_reduction.py " + " ".join(sys.argv[1:]), "commit": commit,
           "rounds": args.rounds, "steps": args.steps, "results": results}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "loss_reduction.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\n| setting | unaligned gradient bytes per device step, Keras' sum -> tfdist's mean | "
          "ms per step, Keras' sum | tfdist's mean | ratio (range) |")
    print("| --- | --- | --- | --- | --- |")
    for setting, r in results.items():
        u, q = r["unaligned_bytes_per_device"], r["range"]
        print(f"| {setting} | {u['keras_sum'] / 1e6:.2f} MB -> {u['tfdist_mean'] / 1e6:.2f} MB | "
              f"{statistics.median(r['ms']['keras_sum']):.1f} | {statistics.median(r['ms']['tfdist_mean']):.1f} | "
              f"{r['ratio tfdist_mean/keras_sum (median of per-round ratios)']:.3f} ({q[0]:.2f}-{q[1]:.2f}) |")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
