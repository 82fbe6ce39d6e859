"""What importing tfdist costs code it does not distribute.

    python benchmarks/plain_code_overhead.py [--rounds 5] [--calls 3000]

tfdist installs rows on TF's and Keras' call paths (``ConcreteFunction._call_flat``,
``GradientTape.gradient``, Keras' ``Layer.__call__``, ...). Each of them first asks whether the
call can involve tfdist and otherwise hands it to TF's or Keras' own function. This measures the
price of that question on plain code, in fresh processes, interleaved in rounds:

- ``plain``: no tfdist;
- ``tfdist_imported``: ``import tfdist.keras`` first, nothing distributed;
- ``tfdist_in_use``: the same, and a model on a 2x4 mesh exists in the process (tfdist's DTensor
  checks then run on every call and find nothing to do).

Timed (median of ``--calls`` calls, per process): a plain ``tf.function`` with 4 arguments and 32
captured variables; an eager call of a plain 4-layer Keras MLP; an eager ``GradientTape.gradient``
through it. Every process also prints the results it computed, which must be equal.
Writes results/plain_code_overhead.json and prints a table of medians and ratios to ``plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PROGRAMS = ("plain", "tfdist_imported", "tfdist_in_use")
CASES = ("tf_function_us", "keras_eager_call_us", "eager_tape_us")


def _per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        samples.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    return statistics.median(samples)


def child(program: str, calls: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]  # 8 logical CPUs in every program, as tfdist's tests
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    if program != "plain":
        import tfdist
        import tfdist.keras  # noqa: F401
    import keras

    if program == "tfdist_in_use":
        from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        other = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="up"),
                                  keras.layers.Dense(8, name="down")])
        parallelize_module(other, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        other(np.ones((8, 16), "float32"))

    keras.utils.set_random_seed(0)
    captured = [tf.Variable(tf.fill((4, 4), float(i))) for i in range(32)]

    @tf.function
    def plain(a, b, c, d):
        return a @ b + c * d + tf.add_n([v[0, 0] for v in captured])

    args = [tf.ones((4, 4)) * (i + 1) for i in range(4)]
    mlp = keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(32, activation="relu") for _ in range(4)])
    x = tf.constant(np.random.default_rng(0).standard_normal((8, 32)).astype("float32"))

    def tape_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mlp(x))
        return tape.gradient(loss, mlp.trainable_variables)

    result = {
        "tf_function_us": _per_call_us(lambda: plain(*args), calls),
        "keras_eager_call_us": _per_call_us(lambda: mlp(x), calls // 3),
        "eager_tape_us": _per_call_us(tape_step, calls // 6),
        "values": [float(plain(*args).numpy().sum()), float(mlp(x).numpy().sum()),
                   float(sum(tf.reduce_sum(g).numpy() for g in tape_step()))],
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--child", choices=PROGRAMS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.calls)
        return
    from _common import print_table, write_results

    runs: dict[str, list[dict]] = {p: [] for p in PROGRAMS}
    for r in range(args.rounds):
        order = PROGRAMS if r % 2 == 0 else tuple(reversed(PROGRAMS))
        for program in order:
            out = subprocess.run([sys.executable, __file__, "--child", program, "--calls", str(args.calls)],
                                 capture_output=True, text=True, check=True, timeout=900)
            runs[program].append(json.loads(out.stdout.strip().splitlines()[-1]))
    reference = runs["plain"][0]["values"]
    for program, results in runs.items():
        for result in results:
            assert result["values"] == reference, (program, result["values"], reference)
    rows = []
    for program in PROGRAMS:
        row = {"program": program}
        for case in CASES:
            row[case] = round(statistics.median(x[case] for x in runs[program]), 2)
            ratios = [x[case] / p[case] for x, p in zip(runs[program], runs["plain"])]  # per round
            row[case.replace("_us", "_ratio")] = round(statistics.median(ratios), 3)
            row[case.replace("_us", "_ratio_range")] = [round(min(ratios), 3), round(max(ratios), 3)]
        rows.append(row)
    path = write_results("plain_code_overhead", rows, {"rounds": args.rounds, "calls": args.calls,
                                                       "values_equal": True, "runs": runs})
    print_table(rows, ["program"] + [c for c in rows[0] if c != "program" and not c.endswith("range")])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
