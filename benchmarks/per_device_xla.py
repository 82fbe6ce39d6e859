"""Per-device XLA programs on 8 virtual CPUs: where compiling each device's share pays, and where not.

    python benchmarks/per_device_xla.py [--rounds 3]

Two workloads, each program in its own fresh process (no compile cache carried over), the
programs of a workload rotating their order every round:

``block``: 48 residual dense layers of width 256 with gelu, forward and backward (the gradient of a sum of
squares with respect to 4 shared weights), batch 64 per device, data parallel on 8 devices:

- ``tf_dtensor``: the step as a plain TF DTensor program (TF ops on every device);
- ``local_map``: the same step with the per-device forward/backward in ``local_map`` (TF ops,
  vectorised over the devices);
- ``local_map_xla``: ``local_map(..., jit_compile=True)`` (one XLA program per device);
- ``one_device_xla``: one device's share alone, ``tf.function(jit_compile=True)`` (batch 64).

``gemma``: keras-hub's Gemma backbone (4 layers, hidden 256, vocabulary 1024, sequence 64) as a
causal LM, ``model.fit`` under ``DataParallel`` on 8 devices, batch 16, SGD:

- ``jit_false`` / ``jit_true``: Keras' ``jit_compile`` off (TF ops, tfdist's default on CPU,
  Keras' ``"auto"`` here) and on (each device's forward and backward one XLA program);
- ``one_device`` / ``one_device_xla``: the same fit on one device, no distribution.

Each process reports its first call (first epoch for ``gemma``, tracing and compiling included),
its step time (median) and a checksum of what it computed; the checksums of a workload must
agree (float32: 1e-4 relative for ``block``, 1e-3 for ``gemma``'s loss after 32 SGD steps).  Writes ``results/per_device_xla.json`` and prints a table.
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
from _common import print_table, write_results  # noqa: E402

WORKLOADS = {
    "block": ["tf_dtensor", "local_map", "local_map_xla", "one_device_xla"],
    "gemma": ["jit_false", "jit_true", "one_device", "one_device_xla"],
}
DEPTH, WIDTH, ROWS = 48, 256, 64


def _block_worker(program: str) -> dict:
    import numpy as np

    import tfdist

    tfdist.virtual_cpus(8)
    import tensorflow as tf

    from tfdist.tensor import Partial, Replicate, Shard, distribute_tensor
    from tfdist.tensor.experimental import local_map

    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((8 * ROWS, WIDTH)).astype(np.float32)
    w_np = (rng.standard_normal((4, WIDTH, WIDTH)) * 0.02).astype(np.float32)

    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            h = x
            for i in range(DEPTH):
                h = h + tf.nn.gelu(h @ w[i % 4])  # residual: the gradient neither vanishes nor explodes
            loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, w)

    if program == "one_device_xla":
        step = tf.function(grads, jit_compile=True)
        args = (tf.constant(x_np[:ROWS]), tf.constant(w_np))
        check = lambda g: float(tf.reduce_sum(g))  # noqa: E731  (one device's share: not compared)
    else:
        mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        x = distribute_tensor(x_np, mesh, [Shard(0)])
        w = distribute_tensor(w_np, mesh, [Replicate()])
        if program == "tf_dtensor":
            step = tf.function(lambda x, w: grads(x, w))
            args = (x._physical, w._physical)
            check = lambda g: float(tf.experimental.dtensor.unpack(tf.reduce_sum(g))[0])  # noqa: E731
        else:
            # each device's gradient of its rows: a Partial sum over dp, reduced by the caller
            per_device = local_map(grads, [Partial()], jit_compile=program == "local_map_xla")
            step = tf.function(lambda x, w: per_device(x, w).redistribute(mesh, [Replicate()])._physical)
            args = (x, w)
            check = lambda g: float(tf.experimental.dtensor.unpack(tf.reduce_sum(g))[0])  # noqa: E731
    start = time.perf_counter()
    g = step(*args)
    value = check(g)
    first = time.perf_counter() - start
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        check(step(*args))
        samples.append(time.perf_counter() - start)
    return {"first_s": round(first, 2), "step_ms": round(1e3 * statistics.median(samples), 1),
            "check": None if program == "one_device_xla" else value}


def _gemma_worker(program: str) -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if not program.startswith("one_device"):
        import tfdist

        tfdist.virtual_cpus(8)
    import keras
    import keras_hub.models as hub
    import numpy as np

    import tfdist.keras  # noqa: F401

    if not program.startswith("one_device"):
        keras.distribution.set_distribution(keras.distribution.DataParallel(
            device_mesh=keras.distribution.DeviceMesh((8,), ["batch"])))
    lm = hub.GemmaCausalLM(backbone=hub.GemmaBackbone(
        num_layers=4, hidden_dim=256, intermediate_dim=512, vocabulary_size=1024, num_query_heads=4,
        num_key_value_heads=4, head_dim=64), preprocessor=None)
    rng = np.random.default_rng(0)
    lm.set_weights([(rng.standard_normal(w.shape) * 0.02).astype(w.dtype) if w.ndim > 1 else w
                    for w in lm.get_weights()])
    ids = rng.integers(0, 1024, size=(128, 64)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    lm.compile(optimizer=keras.optimizers.SGD(0.1),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               jit_compile=program.endswith("xla") or program == "jit_true")
    start = time.perf_counter()
    losses = lm.fit(x, ids, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
    first = time.perf_counter() - start
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        losses += lm.fit(x, ids, batch_size=16, epochs=1, verbose=0, shuffle=False).history["loss"]
        steps.append((time.perf_counter() - start) / 8)
    return {"first_s": round(first, 2), "step_ms": round(1e3 * statistics.median(steps), 1),
            "check": losses[-1]}


def _run(workload: str, program: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", workload, program], capture_output=True,
                         text=True, timeout=1200, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if out.returncode != 0:
        raise RuntimeError(f"{workload}/{program} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="block,gemma")
    parser.add_argument("--worker", nargs=2)
    args = parser.parse_args()
    if args.worker:
        workload, program = args.worker
        result = (_block_worker if workload == "block" else _gemma_worker)(program)
        print(json.dumps(result))
        return
    runs: dict = {}
    for r in range(args.rounds):
        for workload in args.workloads.split(","):
            programs = WORKLOADS[workload]
            order = programs[r % len(programs):] + programs[:r % len(programs)]
            for program in order:
                result = _run(workload, program)
                runs.setdefault((workload, program), []).append(result)
                print(f"round {r} {workload}/{program}: {result}", flush=True)
    rows = []
    for workload in args.workloads.split(","):
        checks = [run["check"] for p in WORKLOADS[workload] for run in runs[(workload, p)] if run["check"] is not None]
        spread = (max(checks) - min(checks)) / max(abs(statistics.median(checks)), 1e-12)
        if spread > (1e-4 if workload == "block" else 1e-3):
            raise SystemExit(f"{workload}: the programs computed different results: {checks}")
        base = statistics.median(run["step_ms"] for run in runs[(workload, WORKLOADS[workload][0])])
        for program in WORKLOADS[workload]:
            got = runs[(workload, program)]
            step = statistics.median(run["step_ms"] for run in got)
            rows.append({"workload": workload, "program": program,
                         "step_ms": step, "step_ms_per_round": [run["step_ms"] for run in got],
                         f"step_vs_{WORKLOADS[workload][0]}": round(step / base, 2),
                         "first_s": statistics.median(run["first_s"] for run in got),
                         "first_s_per_round": [run["first_s"] for run in got],
                         "check": got[-1]["check"]})
    path = write_results("per_device_xla", rows, {"rounds": args.rounds, "devices": 8,
                                                  "note": "one_device_xla of block: one device's share (batch 64)"})
    print_table(rows, ["workload", "program", "step_ms", "first_s", "step_vs_tf_dtensor", "step_vs_jit_false"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
