"""keras-hub's own model and layout map: Keras on JAX against Keras on TensorFlow with tfdist.

    python benchmarks/keras_hub_vs_jax.py [--family gemma|llama] [--rounds 3] [--steps 8]

The alternative a Keras user has for model parallelism today is Keras on JAX
with the same ``LayoutMap``. Both run keras-hub's backbone (4 layers, hidden
256, vocabulary 1024, sequence 64, batch 16) under
``ModelParallel(layout_map=Backbone.get_layout_map(mesh))`` on a 2x4
``(batch, model)`` mesh of 8 virtual CPUs, trained with SGD on the same
data from the same weights (drawn with numpy, so both backends start equal).

Two more programs are the same model on one device: Keras' default on TF (no
distribution, no tfdist), the compile-time reference of the speed issue (the
first epoch on a mesh no slower than one device's), and Keras on JAX, which
says what the compiler-based alternative's mesh costs against its own one
device on this host. Besides the first epoch, each program's compile time is
estimated as its first epoch minus its steps at its measured step time: the 8
virtual devices share the host's cores, so a mesh's step here is slower than
one device's whatever compiles it.

Each program runs in its own fresh process (JAX with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``); a round runs all
three, the order rotating every round. A process reports its first epoch (tracing
and compiling included), its step time (median of ``--blocks`` fit calls of
``--steps`` steps each, after that epoch), its peak resident memory and its
losses; the losses of the two backends must agree (float32, 1e-3).

(Not ``keras_hub.py``: a script of that name would shadow the package it imports.)
Writes ``results/keras_hub_<family>.json`` and prints a Markdown table.
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
CONFIG = dict(num_layers=4, hidden_dim=256, intermediate_dim=512, vocabulary_size=1024)
BATCH, SEQ = 16, 64


def _backbone(hub, family: str):
    if family == "gemma":
        return hub.GemmaBackbone(num_query_heads=4, num_key_value_heads=4, head_dim=64, **CONFIG)
    return hub.LlamaBackbone(num_query_heads=4, num_key_value_heads=4, **CONFIG)


PROGRAMS = {"jax": "Keras on JAX, 2x4", "tensorflow": "Keras on TF with tfdist, 2x4",
            "one_device": "Keras on TF, one device (no tfdist)", "jax_one_device": "Keras on JAX, one device"}


def worker(program: str, family: str, steps: int, blocks: int) -> None:
    os.environ["KERAS_BACKEND"] = "jax" if program.startswith("jax") else "tensorflow"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if program == "jax":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    elif program == "tensorflow":
        import tfdist

        tfdist.virtual_cpus(8)
    import resource

    import keras
    import keras_hub.models as hub
    import numpy as np

    if program == "tensorflow":
        import tfdist.keras  # noqa: F401  (keras.distribution on TensorFlow)
    backbone_cls = hub.GemmaBackbone if family == "gemma" else hub.LlamaBackbone
    lm_cls = hub.GemmaCausalLM if family == "gemma" else hub.LlamaCausalLM
    if program in ("jax", "tensorflow"):
        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=keras.distribution.list_devices())
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=backbone_cls.get_layout_map(mesh), batch_dim_name="batch"))
    lm = lm_cls(backbone=_backbone(hub, family), preprocessor=None)
    rng = np.random.default_rng(0)  # the same starting weights on both backends
    lm.set_weights([(rng.standard_normal(w.shape) * 0.02).astype(w.dtype) if w.ndim > 1 else w
                    for w in lm.get_weights()])
    lm.compile(optimizer=keras.optimizers.SGD(0.1),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = rng.integers(0, CONFIG["vocabulary_size"], (BATCH * steps, SEQ)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    y = np.roll(ids, -1, axis=1)

    def epoch() -> tuple[float, float]:
        start = time.perf_counter()
        history = lm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        return time.perf_counter() - start, float(history.history["loss"][0])

    first_s, first_loss = epoch()
    times, losses = [], [first_loss]
    for _ in range(blocks):
        seconds, loss = epoch()
        times.append(seconds / steps * 1e3)
        losses.append(loss)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step_ms = statistics.median(times)
    print("RESULT " + json.dumps(dict(backend=program, first_epoch_s=first_s, step_ms=step_ms,
                                      compile_s=first_s - steps * step_ms / 1e3,
                                      step_ms_blocks=times, peak_rss_mb=peak_mb, losses=losses)), flush=True)


def _run(program: str, family: str, steps: int, blocks: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", program, family, str(steps),
                           str(blocks)], capture_output=True, text=True, env=env, timeout=3600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{program} worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["gemma", "llama"], default="gemma")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        backend, family, steps, blocks = args.worker
        worker(backend, family, int(steps), int(blocks))
        return
    sys.path.insert(0, HERE)
    from _common import write_results

    runs: dict[str, list[dict]] = {program: [] for program in PROGRAMS}
    for r in range(args.rounds):
        order = list(PROGRAMS)[r % len(PROGRAMS):] + list(PROGRAMS)[:r % len(PROGRAMS)]
        for program in order:
            runs[program].append(_run(program, args.family, args.steps, args.blocks))
            print(f"round {r} {program}: {runs[program][-1]['step_ms']:.0f} ms/step, "
                  f"first epoch {runs[program][-1]['first_epoch_s']:.1f} s", flush=True)
        a = runs["jax"][-1]["losses"]
        for program in ("tensorflow", "one_device", "jax_one_device"):
            b = runs[program][-1]["losses"]
            if max(abs(p - q) for p, q in zip(a, b)) > 1e-3 * max(1.0, abs(a[0])):
                raise SystemExit(f"round {r}: the losses differ: jax {a} {program} {b}")
    rows = []
    for program, label in PROGRAMS.items():
        rs = runs[program]
        rows.append({"run": label, "step ms (median of rounds)": round(statistics.median(r["step_ms"] for r in rs), 1),
                     "step ms range": [round(min(r["step_ms"] for r in rs), 1), round(max(r["step_ms"] for r in rs), 1)],
                     "first epoch s": round(statistics.median(r["first_epoch_s"] for r in rs), 1),
                     "compile s": round(statistics.median(r["compile_s"] for r in rs), 1),
                     "peak RSS MB": round(statistics.median(r["peak_rss_mb"] for r in rs)),
                     "losses": rs[0]["losses"]})
    def per_round(key: str, other: str, this: str = "tensorflow") -> list[float]:
        return [t[key] / o[key] for t, o in zip(runs[this], runs[other])]

    ratios = per_round("step_ms", "jax")
    meta = {"family": args.family, "config": {**CONFIG, "batch": BATCH, "seq": SEQ}, "rounds": args.rounds,
            "steps": args.steps, "blocks": args.blocks, "step ratio tfdist/jax per round": ratios,
            "first epoch ratio tfdist/jax per round": per_round("first_epoch_s", "jax"),
            "first epoch ratio tfdist/one device per round": per_round("first_epoch_s", "one_device"),
            "compile ratio tfdist/one device per round": per_round("compile_s", "one_device"),
            "first epoch ratio jax/jax one device per round": per_round("first_epoch_s", "jax_one_device", "jax"),
            "compile ratio jax/jax one device per round": per_round("compile_s", "jax_one_device", "jax"),
            "runs": runs}
    path = write_results(f"keras_hub_{args.family}", rows, meta)
    print("| run | step ms (median, range) | first epoch s | compile s | peak RSS MB |")
    print("|---|---|---|---|---|")
    for row in rows:
        lo, hi = row["step ms range"]
        print(f"| {row['run']} | {row['step ms (median of rounds)']} ({lo}-{hi}) | {row['first epoch s']} | "
              f"{row['compile s']} | {row['peak RSS MB']} |")
    for what, key in (("step time", "step ratio tfdist/jax per round"),
                      ("first epoch", "first epoch ratio tfdist/jax per round")):
        print(f"tfdist / JAX {what}, per round: {', '.join(f'{x:.2f}' for x in meta[key])}")
    for key in ("first epoch ratio tfdist/one device per round", "compile ratio tfdist/one device per round",
                "first epoch ratio jax/jax one device per round", "compile ratio jax/jax one device per round"):
        print(f"{key.replace(' per round', '')}, per round: {', '.join(f'{x:.2f}' for x in meta[key])}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
