"""TF DTensor's all-reduce against MirroredStrategy's on 8 virtual CPUs: why tfdist's
DataParallel ``fit`` is slower than MirroredStrategy's on this host (docs/design.md).

    python benchmarks/all_reduce_cpu.py [--rounds 3] [--mb 8.4]

Each round runs, in fresh processes, one all-reduce (sum) of an ``--mb`` float32 tensor over
8 virtual CPUs, 20 times inside a ``tf.function``:

- ``dtensor``: a tensor sharded on dim 0 of a 1-D mesh of 8, summed over that dim (TF DTensor
  lowers it to one ``CollectiveReduceV2`` per device, ``max_subdivs_per_device=16``);
- ``mirrored``: ``MirroredStrategy`` on the same 8 devices, ``reduce_to(SUM)`` of per-replica
  values (its ``CollectiveAllReduce``).

Both first scale their input by 1.5 (so nothing is constant-folded) and both results are
checked against 8 x 1.5.  Writes ``results/all_reduce_cpu.json`` and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from _common import RESULTS  # noqa: E402  (the results folder; run_all.py --quick moves it)

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(program: str, n: int) -> None:
    import time

    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    if program == "dtensor":
        mesh = dtensor.create_mesh([("b", 8)], devices=[f"CPU:{i}" for i in range(8)])
        x = dtensor.call_with_layout(tf.ones, dtensor.Layout(["b", dtensor.UNSHARDED], mesh), [8, n])
        f = tf.function(lambda x: tf.reduce_sum(x * 1.5, 0))
        run = lambda: f(x)  # noqa: E731
        first = lambda r: dtensor.unpack(r)[0].numpy()  # noqa: E731
    else:
        strategy = tf.distribute.MirroredStrategy([f"/CPU:{i}" for i in range(8)])
        values = strategy.experimental_distribute_values_from_function(lambda ctx: tf.ones([n]))

        @tf.function
        def f(values):
            v = strategy.run(lambda a: a * 1.5, args=(values,))
            return strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, v, destinations=v)

        run = lambda: f(values)  # noqa: E731
        first = lambda r: strategy.experimental_local_results(r)[0].numpy()  # noqa: E731
    np.testing.assert_allclose(first(run()), 12.0)  # 8 replicas x 1.5
    start = time.perf_counter()
    for _ in range(20):
        result = run()
    first(result)
    print("RESULT " + json.dumps({"ms": (time.perf_counter() - start) / 20 * 1e3}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=8.4)
    parser.add_argument("--worker", nargs=2, metavar=("PROGRAM", "N"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]))
    n = int(args.mb * 1e6 / 4)
    runs: dict = {"dtensor": [], "mirrored": []}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for r in range(args.rounds):
        for program in (["dtensor", "mirrored"] if r % 2 == 0 else ["mirrored", "dtensor"]):
            out = subprocess.run([sys.executable, __file__, "--worker", program, str(n)],
                                 capture_output=True, text=True, env=env, timeout=600).stdout
            runs[program].append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])["ms"])
    medians = {p: statistics.median(v) for p, v in runs.items()}
    result = {"megabytes": args.mb, "devices": 8, "rounds": args.rounds, "ms_per_round": runs, "median_ms": medians,
              "ratio_dtensor_over_mirrored": medians["dtensor"] / medians["mirrored"]}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "all_reduce_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"all-reduce of {args.mb} MB over 8 virtual CPUs, median of {args.rounds} rounds:")
    for program, ms in medians.items():
        print(f"  {program:9s} {ms:7.2f} ms")
    print(f"  ratio dtensor / mirrored: {result['ratio_dtensor_over_mirrored']:.2f}")


if __name__ == "__main__":
    main()
