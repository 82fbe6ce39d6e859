"""Where the time of a tfdist ``fit`` step goes, next to the same step written by hand: one
process, 8 virtual CPUs, a workload of ``compare.py`` (W1: MLP 2.1M; W2: tiny GPT; Adam) on a
2x4 (dp, tp) mesh.

    python benchmarks/fit_host_cost.py [--workload W1] [--rounds 10] [--steps 40]

In one process, alternating blocks (the order flips every round), each measured over the
steps after 10 warm-up steps:

- ``fit``: Keras 3 ``fit`` after ``parallelize_module`` (W1: column/row parallel; W2:
  ``parallelize_gpt``'s default plan, vocabulary-sharded logits), one epoch, with a callback
  that watches batch ends (so every step waits for its logs, as Keras 3 on TensorFlow does);
- ``hand``: the same step by hand in raw TF DTensor (``_handwritten.py``), reading its loss
  every step;
- ``fit_lagged``: ``fit`` with that callback declared ``async_safe``: its batch-end calls run
  one step behind (docs/keras.md); ``hand_lagged``: the hand-written loop reading step k's
  loss after dispatching step k+1; ``hand_unsynced``: reading it only at the two marks;
- ``feed`` / ``hand_place``: only the batches -- tfdist's ``BatchFeed`` (a tf.data split stage
  plus ``dtensor.pack``) against the hand-written ``tf.split`` + ``dtensor.pack``;
- ``fit_step`` / ``hand_step``: only the traced step programs, called on one placed batch.

Each reports wall ms per step and the main thread's CPU ms per step (``time.thread_time``:
the host work that, on a 2-core host, competes with the 8 device threads).  Writes
``results/fit_host_cost.json`` (``fit_host_cost_W2.json`` for W2) and prints medians and paired ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from _common import RESULTS  # noqa: E402  (the results folder; run_all.py --quick moves it)

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per block, after 10 warm-up steps")
    parser.add_argument("--workload", default="W1", choices=["W1", "W2"])
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    import numpy as np
    import tfdist

    tfdist.virtual_cpus(8)
    import keras
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    import _handwritten
    import compare
    import tfdist.keras  # noqa: F401
    from tfdist.keras import _data
    from tfdist.keras._trainer import mesh_of
    from tfdist.models import parallelize_gpt
    from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n = WARMUP + args.steps
    w = dict(compare.WORKLOADS[args.workload], steps=n)
    mlp = w["kind"] == "mlp"
    x, y = compare._data(w)
    b = w["batch"]
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))

    model = compare._keras_model(keras, w)
    if mlp:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    else:
        parallelize_gpt(model, mesh)
    model.compile(optimizer=keras.optimizers.Adam(w["lr"]), loss=compare._loss(keras, w))
    model.fit(x[:2 * b], y[:2 * b], batch_size=b, epochs=1, verbose=0, shuffle=False)  # trace
    fit_mesh, batch_axis = mesh_of(model)
    fit_step_fn = model.train_function.one_step.traced[0]

    tf_mesh = dtensor.create_mesh([("dp", 2), ("tp", 4)], devices=[f"CPU:{i}" for i in range(8)])
    hand_step = _handwritten.train_step(compare._keras_model(keras, w), tf_mesh, w)

    def place(batch):
        return _handwritten.place_by_dp(batch, tf_mesh)

    def scalar(t):
        return float(dtensor.unpack(t)[0]) if dtensor.is_dtensor(t) else float(t)

    def timed(marks):  # (wall, main-thread cpu) per step between the end of warm-up and the end
        (t0, c0), (t1, c1) = marks
        return {"wall_ms": (t1 - t0) / args.steps * 1e3, "cpu_ms": (c1 - c0) / args.steps * 1e3}

    def now():
        return time.perf_counter(), time.thread_time()

    def run_fit(async_safe: bool):
        marks = []

        class Mark(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch in (WARMUP - 1, n - 1):
                    float(logs["loss"])  # step ``batch`` has ended (with a lag, the next is dispatched)
                    marks.append(now())

        Mark.async_safe = async_safe  # False: it watches batch ends, so every step waits for it
        model.fit(x, y, batch_size=b, epochs=1, verbose=0, shuffle=False, callbacks=[Mark()])
        return timed(marks)

    def run_hand(reads: str):
        """``every``: reads each step's loss before the next step; ``behind``: reads step k's
        after dispatching step k+1; ``ends``: only at the two marks."""
        marks, previous = [], None
        for i in range(n):
            loss = hand_step(place(x[i * b:(i + 1) * b]), place(y[i * b:(i + 1) * b]))
            if reads == "every":
                scalar(loss)
            elif reads == "behind" and previous is not None:
                scalar(previous)
            previous = loss
            if i in (WARMUP - 1, n - 1):
                scalar(loss)
                marks.append(now())
        return timed(marks)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(b)

    def run_feed():
        feed = _data.BatchFeed(iter(dataset), fit_mesh, batch_axis, fresh=True)
        marks = []
        for i, _ in enumerate(feed):
            if i in (WARMUP - 1, n - 1):
                marks.append(now())
        return timed(marks)

    def run_hand_place():
        marks = []
        for i in range(n):
            place(x[i * b:(i + 1) * b]), place(y[i * b:(i + 1) * b])
            if i in (WARMUP - 1, n - 1):
                marks.append(now())
        return timed(marks)

    fit_batch = _data.shard_batch((tf.constant(x[:b]), tf.constant(y[:b])), fit_mesh, batch_axis)
    hand_batch = (place(x[:b]), place(y[:b]))

    def steps_only(fn, *batch):
        def run():
            marks = []
            for i in range(n):
                out = fn(*batch)
                if i in (WARMUP - 1, n - 1):
                    scalar(tf.nest.flatten(out)[0])
                    marks.append(now())
            return timed(marks)
        return run

    programs = {"fit": lambda: run_fit(False), "hand": lambda: run_hand("every"),
                "fit_lagged": lambda: run_fit(True), "hand_lagged": lambda: run_hand("behind"),
                "hand_unsynced": lambda: run_hand("ends"), "feed": run_feed, "hand_place": run_hand_place,
                "fit_step": steps_only(fit_step_fn, fit_batch), "hand_step": steps_only(hand_step, *hand_batch)}
    runs: dict = {p: [] for p in programs}
    for r in range(args.rounds):
        for p in (list(programs) if r % 2 == 0 else list(programs)[::-1]):
            runs[p].append(programs[p]())
    summary = {p: {k: statistics.median(v[k] for v in rs) for k in ("wall_ms", "cpu_ms")} for p, rs in runs.items()}
    pairs = {}
    for a, c in (("fit", "hand"), ("fit_lagged", "hand_lagged"), ("fit_lagged", "hand_unsynced"),
                 ("fit_lagged", "fit"), ("feed", "hand_place"), ("fit_step", "hand_step")):
        for k in ("wall_ms", "cpu_ms"):
            pairs[f"{a}/{c} {k}"] = statistics.median(p[k] / q[k] for p, q in zip(runs[a], runs[c]))
    commit = os.popen(f"git -C {HERE} rev-parse --short HEAD").read().strip()
    result = {"command": "python benchmarks/fit_host_cost.py " + " ".join(sys.argv[1:]), "commit": commit,
              "workload": args.workload,
              "rounds": args.rounds, "timed_steps": args.steps, "summary": summary, "paired_ratios": pairs,
              "runs": runs}
    os.makedirs(RESULTS, exist_ok=True)
    name = "fit_host_cost.json" if args.workload == "W1" else f"fit_host_cost_{args.workload}.json"
    with open(os.path.join(RESULTS, name), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.workload} on 2x4, {args.rounds} alternating rounds of {args.steps} steps (medians, per step):")
    print("| program | wall ms | main-thread CPU ms |\n| --- | --- | --- |")
    for p, row in summary.items():
        print(f"| {p} | {row['wall_ms']:.2f} | {row['cpu_ms']:.2f} |")
    print("\n| paired ratio (median over rounds) | value |\n| --- | --- |")
    for name, value in pairs.items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
