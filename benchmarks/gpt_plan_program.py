"""W2's step program under ``parallelize_gpt`` against the same model under a
``keras.distribution`` LayoutMap with the same weight layouts: one process, 8 virtual CPUs,
2x4 (dp, tp) mesh, the programs ``fit`` traces (Keras' Adam, the GPT of compare.py).

    python benchmarks/gpt_plan_program.py [--rounds 5] [--steps 20]

For each program: the collectives TF executes and their bytes (CommDebugMode), the op count
of the traced graph by type (relayouts, matmuls, cross-entropy), and the wall ms per step in
alternating blocks of ``--steps`` steps (the order flips every round).  Writes
``results/gpt_plan_program.json`` and prints the table and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from _common import RESULTS  # noqa: E402  (the results folder; run_all.py --quick moves it)

HERE = os.path.dirname(os.path.abspath(__file__))
COUNTED = ("Relayout", "RelayoutLike", "Einsum", "MatMul", "BatchMatMulV2", "GatherV2", "OneHot",
           "SelectV2", "SparseSoftmaxCrossEntropyWithLogits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    import tfdist

    tfdist.virtual_cpus(8)
    import keras
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    import compare
    import tfdist.keras  # noqa: F401
    from tfdist.keras import _data
    from tfdist.keras._trainer import mesh_of
    from tfdist.models import parallelize_gpt
    from tfdist.tensor.debug import CommDebugMode

    w = dict(compare.WORKLOADS["W2"], steps=4)
    x, y = compare._data(w)
    b = w["batch"]

    def traced_step(model):
        model.compile(optimizer=keras.optimizers.Adam(w["lr"]), loss=compare._loss(keras, w))
        model.fit(x[:2 * b], y[:2 * b], batch_size=b, epochs=1, verbose=0, shuffle=False)
        mesh, batch_axis = mesh_of(model)
        data = _data.shard_batch((tf.constant(x[:b]), tf.constant(y[:b])), mesh, batch_axis)
        one_step = model.train_function.one_step
        return (lambda: one_step(data, True)), one_step.traced[0].get_concrete_function(data).graph

    # the LayoutMap model first: its keys are the variable paths of a fresh process
    device_mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for key, axes in compare._gpt_layout_map().items():
        layout_map[key] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    programs = {"layout_map": traced_step(compare._keras_model(keras, w))}
    keras.distribution.set_distribution(None)
    model = compare._keras_model(keras, w)
    parallelize_gpt(model, tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")))
    programs["parallelize_gpt"] = traced_step(model)

    def scalar(out):
        return float(dtensor.unpack(tf.nest.flatten(out)[0])[0])

    result = {}
    for name, (run, graph) in programs.items():
        scalar(run())
        with CommDebugMode() as comm:
            scalar(run())
        ops = collections.Counter(op.type for op in graph.get_operations())
        result[name] = {"collectives": dict(comm.get_comm_counts()),
                        "collective_bytes": {k: float(v) for k, v in comm.get_comm_bytes().items()},
                        "graph_ops": sum(ops.values()), "ops": {k: ops[k] for k in COUNTED}}

    def block(run):
        scalar(run())
        start = time.perf_counter()
        for _ in range(args.steps):
            out = run()
        scalar(out)
        return (time.perf_counter() - start) / args.steps * 1e3

    times = {name: [] for name in programs}
    for r in range(args.rounds):
        for name in (list(programs) if r % 2 == 0 else list(programs)[::-1]):
            times[name].append(block(programs[name][0]))
    ratio = statistics.median(a / c for a, c in zip(times["parallelize_gpt"], times["layout_map"]))
    for name in programs:
        result[name]["step_ms"] = statistics.median(times[name])
        result[name]["step_ms_rounds"] = times[name]
    commit = os.popen(f"git -C {HERE} rev-parse --short HEAD").read().strip()
    out = {"command": "python benchmarks/gpt_plan_program.py " + " ".join(sys.argv[1:]), "commit": commit,
           "rounds": args.rounds, "steps": args.steps, "programs": result,
           "parallelize_gpt/layout_map step_ms (median of per-round ratios)": ratio}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "gpt_plan_program.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("| program | step ms | collectives | collective MB | graph ops | " + " | ".join(COUNTED) + " |")
    print("| --- " * (5 + len(COUNTED)) + "|")
    for name, row in result.items():
        mb = sum(row["collective_bytes"].values()) / 1e6
        print(f"| {name} | {row['step_ms']:.1f} | {row['collectives']} | {mb:.2f} | {row['graph_ops']} | "
              + " | ".join(str(row["ops"][k]) for k in COUNTED) + " |")
    print(f"\nparallelize_gpt / layout_map step time (median of {args.rounds} per-round ratios): {ratio:.3f}")


if __name__ == "__main__":
    main()
