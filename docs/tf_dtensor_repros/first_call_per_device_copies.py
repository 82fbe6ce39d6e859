"""TF DTensor (2.21) on CPU instantiates a mesh function once per device: the first call's
compile time grows with the mesh's size, for the same program.

    python docs/tf_dtensor_repros/first_call_per_device_copies.py [--layers 48] [--rounds 3]

On TPU, TF DTensor compiles one SPMD program with XLA. On CPU and GPU it runs the expanded
program once per device. The parallel device executes it on each device's own thread,
and each device's copy is instantiated by TF's function runtime. That copy goes through
TF's graph passes: the MLIR bridge's two checks, the inlining of DTensor's call wrapper,
the oneDNN layout pass and the classic graph optimizer. A 2x4 mesh pays for this eight
times, where one device pays once.

The program here is plain TF DTensor, with no tfdist and no Keras: ``--layers`` dense
layers (matmul, bias, gelu), forward and backward, on a batch sharded over the mesh. Its
first call is timed against the next two (median), so the difference is the compile. It runs in four
settings:
  - one device, as plain ``tf.function`` (TF's default: Grappler on);
  - TF DTensor meshes of 1, 2, 4 and 8 of the same 8 virtual CPUs;
  - the 1- and 8-device meshes called with Grappler off, as tfdist calls its CPU step
    programs (``disable_meta_optimizer`` in the call's ``FunctionCallOptions``);
  - no DTensor, the shard_map pattern: the local step (loss and gradients of a batch slice)
    traced once as a ``tf.function``, and one ``tf.function`` that calls it on each of the 8
    devices (``tf.device``) and sums the results, with Grappler on and off. TF's runtime
    partitions that function by device and instantiates each part on its device, so it pays
    per device too.
Each setting runs in its own process, and the settings rotate every round; all compute
the same loss (checked). The script prints the compile time of each setting and the
slope per added device, and writes ``benchmarks/results/first_call_per_device_copies.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = ["one_device", "mesh_1", "mesh_2", "mesh_4", "mesh_8", "mesh_1_no_grappler", "mesh_8_no_grappler",
            "plain_8", "plain_8_no_grappler"]
WIDTH, BATCH = 128, 64


def _grappler_off() -> None:
    """Every later function call without Grappler, as tfdist calls its CPU step programs."""
    from tensorflow.python.eager import context

    config = context.context().config
    config.allow_soft_placement = True
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    context.context().function_call_options = context.FunctionCallOptions(config_proto=config)


def worker(setting: str, layers: int) -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    if setting.endswith("no_grappler"):
        _grappler_off()
    rng = tf.random.Generator.from_seed(0)
    weights = [rng.normal((WIDTH, WIDTH)) * 0.05 for _ in range(layers)]
    x = rng.normal((BATCH, WIDTH))
    size = 1 if setting == "one_device" else int(setting.split("_")[1])
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(size)]
    if setting.startswith("mesh"):
        mesh = dtensor.create_mesh([("batch", size)], devices=devices, device_type="CPU")
        replicated = dtensor.Layout.replicated(mesh, 2)
        weights = [dtensor.copy_to_mesh(w, replicated) for w in weights]
        x = dtensor.relayout(dtensor.copy_to_mesh(x, replicated), dtensor.Layout.batch_sharded(mesh, "batch", 2))

    def loss_of(x, weights):
        h = x
        for w in weights:
            h = tf.nn.gelu(h @ w + 0.01)
        return tf.reduce_mean(h * h)

    def local_step(x, weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            loss = loss_of(x, weights)
        return loss, tape.gradient(loss, weights)

    if setting.startswith("plain"):
        # the shard_map pattern without TF DTensor: the local step traced once, called on each
        # device with its slice of the batch, its results summed; TF partitions the function by
        # device and instantiates each part (the local step's body among them) on its device
        local = tf.function(local_step)

        @tf.function
        def step(x, weights):
            results = []
            for device, piece in zip(devices, tf.split(x, size)):
                with tf.device(device):
                    results.append(local(piece, weights))
            return [tf.add_n(list(parts)) / size for parts in zip(*[[loss, *grads] for loss, grads in results])]
    else:
        step = tf.function(local_step)

    def value(loss) -> float:
        return float(dtensor.unpack(loss)[0].numpy() if setting.startswith("mesh") else loss.numpy())

    times = []
    for _ in range(3):
        start = time.perf_counter()
        loss = step(x, weights)[0]
        value(loss)  # waits for the step
        times.append(time.perf_counter() - start)
    return {"setting": setting, "first_s": times[0], "then_s": statistics.median(times[1:]),
            "compile_s": times[0] - statistics.median(times[1:]), "loss": value(loss)}


def _run(setting: str, layers: int) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", setting, "--layers", str(layers)],
                          capture_output=True, text=True, timeout=1200)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{setting} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.layers)), flush=True)
        return
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in SETTINGS[r % len(SETTINGS):] + SETTINGS[:r % len(SETTINGS)]:
            runs[setting].append(_run(setting, args.layers))
            print(f"round {r} {setting}: first call {runs[setting][-1]['first_s']:.2f} s, "
                  f"then {runs[setting][-1]['then_s'] * 1e3:.1f} ms", flush=True)
    losses = {s: runs[s][0]["loss"] for s in SETTINGS}
    if max(losses.values()) - min(losses.values()) > 1e-4 * abs(losses["one_device"]):
        raise SystemExit(f"the settings compute different losses: {losses}")
    compile_s = {s: statistics.median(r["compile_s"] for r in runs[s]) for s in SETTINGS}
    sizes = [1, 2, 4, 8]
    ys = [compile_s[f"mesh_{k}"] for k in sizes]
    mean_k, mean_y = statistics.mean(sizes), statistics.mean(ys)
    slope = sum((k - mean_k) * (y - mean_y) for k, y in zip(sizes, ys)) / sum((k - mean_k) ** 2 for k in sizes)
    print(f"\n{args.layers} layers; compile = first call - later call (median of {args.rounds} rounds)")
    print("| setting | compile s | x one device |")
    print("|---|---|---|")
    for s in SETTINGS:
        print(f"| {s} | {compile_s[s]:.2f} | {compile_s[s] / compile_s['one_device']:.2f} |")
    print(f"each added device adds {slope:.3f} s (least squares over mesh sizes 1, 2, 4, 8); without Grappler "
          f"{(compile_s['mesh_8_no_grappler'] - compile_s['mesh_1_no_grappler']) / 7:.3f} s (from 1 to 8)")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "results",
                       "first_call_per_device_copies.json")
    with open(out, "w") as f:
        json.dump({"layers": args.layers, "width": WIDTH, "batch": BATCH, "rounds": args.rounds,
                   "cpus": os.cpu_count(), "compile_s_median": compile_s, "slope_s_per_device": slope,
                   "runs": runs}, f, indent=1)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
