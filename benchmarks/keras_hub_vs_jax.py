"""keras-hub models under a layout map: Keras on TensorFlow with tfdist against Keras on JAX.

    python benchmarks/keras_hub_vs_jax.py --family all --workload all --rounds 3
        [--size tiny|large] [--mesh 2x4,4x2] [--steps 16] [--epochs 3] [--one-device] [--devices cpu|gpu]

The alternative a Keras user has for model parallelism is Keras on JAX with the
same ``LayoutMap``. Every case -- a family (Gemma, Llama, Mixtral, GPT-2), a
workload (``lm``: the causal LM with sparse cross-entropy on its logits;
``backbone``: the backbone alone with MSE on its hidden states), a size and a
``(batch, model)`` mesh of 8 virtual CPUs (``--devices gpu``: the host's GPUs) -- trains the same model from the same
weights (drawn with numpy) on the same data with SGD under
``ModelParallel(layout_map=...)``: keras-hub's own ``get_layout_map`` where the
family ships one, else a map in its pattern (``_hub_maps.llama_pattern_map``).

Programs, each in a fresh process, the order rotating every round:

- ``tfdist``: Keras on TF with tfdist;
- ``jax``: Keras on JAX, XLA's default threading;
- ``jax_1thread``: Keras on JAX with one XLA thread per device (the split
  ``tfdist.virtual_cpus`` gives TF's devices);
- with ``--one-device``: Keras on TF and on JAX without a distribution.

The reference of a round is the faster of the two JAX programs (the baseline at
its best known setting on this host). A process reports its first epoch (tracing
and compiling included), its step time (the median over ``--epochs`` epochs of
``--steps`` steps of the epoch's time per step), the per-``fit`` overhead (a
one-step ``fit`` minus one step: it must stay under 5% of an epoch, else the
case is flagged), its peak resident memory, its epoch losses, and its weights
after the timed epochs. Before a ratio is printed every round is checked: each
program's losses against the reference's (relative ``LOSS_RTOL``) and its weight
update (final minus initial) against the reference's (relative ``UPDATE_RTOL``
in norm). A case with a failed check prints the failure and no ratio. Ratios are
medians of the per-round ratios with their range; a round whose step is more
than ``OUTLIER`` times its program's median is reported as an outlier, not
dropped. The host (CPU model, cores, oneDNN state) and every environment switch
each program ran with go into the JSON (``machine``, and each run's ``env``).

(Not ``keras_hub.py``: a script of that name would shadow the package it imports.)
Writes ``results/keras_hub_vs_jax.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("gemma", "llama", "mixtral", "gpt2")
WORKLOADS = ("lm", "backbone")
# tiny: the configs (hidden 256, 4 layers, seq 64); large: where compute dominates
SIZES = {"tiny": dict(num_layers=4, hidden_dim=256, intermediate_dim=1024, vocabulary_size=1024, batch=16, seq=64),
         "large": dict(num_layers=8, hidden_dim=1024, intermediate_dim=4096, vocabulary_size=1024, batch=16, seq=256)}
PROGRAMS = ("tfdist", "jax", "jax_1thread")
ONE_DEVICE = ("tf_one_device", "jax_one_device")
LOSS_RTOL, UPDATE_RTOL, OVERHEAD_MAX, OUTLIER = 1e-3, 1e-2, 0.05, 1.3
JAX_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _backbone(hub, family: str, size: dict):
    common = dict(vocabulary_size=size["vocabulary_size"], num_layers=size["num_layers"],
                  hidden_dim=size["hidden_dim"], intermediate_dim=size["intermediate_dim"])
    heads = size["hidden_dim"] // 64
    if family == "gemma":
        return hub.GemmaBackbone(num_query_heads=heads, num_key_value_heads=heads, head_dim=64, **common)
    if family == "llama":
        return hub.LlamaBackbone(num_query_heads=heads, num_key_value_heads=heads, **common)
    if family == "mixtral":
        return hub.MixtralBackbone(num_query_heads=heads, num_key_value_heads=heads, num_experts=4, top_k=2,
                                   **common)
    return hub.GPT2Backbone(num_heads=heads, dropout=0.0, max_sequence_length=size["seq"], **common)


def _onednn(program: str) -> str:
    if not program.startswith("tf"):
        return "n/a (JAX)"
    from tensorflow.python.util import _pywrap_util_port

    state = "on" if _pywrap_util_port.IsMklEnabled() else "off"
    return f"{state} (TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset')})"


def _model(program: str, case: dict):
    import keras
    import keras_hub.models as hub
    import numpy as np
    from _hub_maps import llama_pattern_map

    family, size = case["family"], SIZES[case["size"]]
    backbone_cls = {"gemma": hub.GemmaBackbone, "llama": hub.LlamaBackbone, "mixtral": hub.MixtralBackbone,
                    "gpt2": hub.GPT2Backbone}[family]
    if not program.endswith("one_device"):
        mesh = keras.distribution.DeviceMesh(tuple(case["mesh"]), ["batch", "model"],
                                             devices=keras.distribution.list_devices())
        layout_map = (backbone_cls.get_layout_map(mesh) if "get_layout_map" in backbone_cls.__dict__
                      else llama_pattern_map(keras, _backbone(hub, family, size), mesh, size["hidden_dim"],
                                             size["vocabulary_size"]))
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
    backbone = _backbone(hub, family, size)
    if case["workload"] == "lm":
        lm_cls = {"gemma": hub.GemmaCausalLM, "llama": hub.LlamaCausalLM, "mixtral": hub.MixtralCausalLM,
                  "gpt2": hub.GPT2CausalLM}[family]
        model, loss = lm_cls(backbone=backbone, preprocessor=None), keras.losses.SparseCategoricalCrossentropy(
            from_logits=True)
    else:
        model, loss = keras.Model(backbone.inputs, backbone.output), keras.losses.MeanSquaredError()
    rng = np.random.default_rng(0)  # the same starting weights on every backend
    model.set_weights([(rng.standard_normal(w.shape) * 0.02).astype(w.dtype) if w.ndim > 1 else w
                       for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    ids = rng.integers(0, size["vocabulary_size"], (size["batch"] * case["steps"], size["seq"])).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    y = (np.roll(ids, -1, axis=1) if case["workload"] == "lm"
         else rng.standard_normal((*ids.shape, size["hidden_dim"])).astype("float32"))
    return model, x, y


def worker(program: str, case: dict, weights_path: str) -> None:
    import resource

    if program == "tfdist":
        import tfdist

        if case.get("devices", "cpu") == "cpu":
            tfdist.virtual_cpus(8)
        import tfdist.keras  # noqa: F401  (keras.distribution on TensorFlow)
    import numpy as np
    from _common import env_switches

    model, x, y = _model(program, case)
    initial = [np.asarray(w) for w in model.get_weights()]
    batch = SIZES[case["size"]]["batch"]

    def fit(xs, ys) -> tuple[float, float]:
        start = time.perf_counter()
        history = model.fit(xs, ys, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        return time.perf_counter() - start, float(history.history["loss"][0])

    first_s, first_loss = fit(x, y)
    epoch_ms, losses = [], [first_loss]
    for _ in range(case["epochs"]):
        seconds, loss = fit(x, y)
        epoch_ms.append(seconds * 1e3)
        losses.append(loss)
    final = [np.asarray(w) for w in model.get_weights()]
    np.savez(weights_path, *[f - i for f, i in zip(final, initial)])
    step_ms = statistics.median(epoch_ms) / case["steps"]
    one = {k: v[:batch] for k, v in x.items()}
    overhead_ms = statistics.median(fit(one, y[:batch])[0] * 1e3 for _ in range(3)) - step_ms
    print("RESULT " + json.dumps(dict(
        program=program, first_epoch_s=first_s, step_ms=step_ms, epoch_ms=epoch_ms,
        fit_overhead_ms=overhead_ms, fit_overhead_share=overhead_ms / statistics.median(epoch_ms),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, losses=losses,
        onednn=_onednn(program), env=env_switches())),
        flush=True)


def _env(program: str, devices: str = "cpu") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["KERAS_BACKEND"] = "jax" if program.startswith("jax") else "tensorflow"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if devices == "cpu" and program.startswith("jax") and program != "jax_one_device":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8" + (
            " " + JAX_ONE_THREAD if program == "jax_1thread" else "")
    return env


def run(program: str, case: dict, weights_path: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", program, json.dumps(case),
                           weights_path], capture_output=True, text=True, env=_env(program, case.get("devices", "cpu")),
                          timeout=7200)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"program": program, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:500]}
    return json.loads(lines[-1][len("RESULT "):])


def update_rel_diff(path: str, reference_path: str) -> float:
    """``|update - reference update| / |reference update|`` over all weights (updates from equal
    starting weights: a wrongly scaled gradient shows here, where Adam would hide it)."""
    import numpy as np

    a, b = np.load(path), np.load(reference_path)
    num = sum(float(np.sum((a[k].astype("float64") - b[k]) ** 2)) for k in b.files)
    den = sum(float(np.sum(b[k].astype("float64") ** 2)) for k in b.files)
    return (num / den) ** 0.5


def check_round(results: dict, reference: str) -> list[str]:
    """The failures of one round: every program's losses and weight update against the reference's."""
    failures = [f"{p}: {r['error']}" for p, r in results.items() if "error" in r]
    ref = results[reference]
    if "error" in ref:
        return failures
    for program, r in results.items():
        if program == reference or "error" in r:
            continue
        loss_diff = max(abs(p - q) / max(abs(q), 1e-12) for p, q in zip(r["losses"], ref["losses"]))
        r["loss_rel_diff"] = loss_diff
        if len(r["losses"]) != len(ref["losses"]) or loss_diff > LOSS_RTOL:
            failures.append(f"{program}: losses {r['losses']} against {reference}'s {ref['losses']}")
        if r.get("update_rel_diff") is None or r["update_rel_diff"] > UPDATE_RTOL:
            failures.append(f"{program}: weight update differs from {reference}'s by {r.get('update_rel_diff')}")
    return failures


def _median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "range": [min(values), max(values)]}


def summarize(rounds: list[dict]) -> dict:
    """One case's summary from its rounds (``{"results": {program: result}, "reference": ...,
    "failures": [...]}``): per program the median and range of its step and first epoch and its
    outlier rounds; the tfdist / reference ratios only if every round passed its checks."""
    programs = [p for p in rounds[0]["results"] if all("error" not in r["results"][p] for r in rounds)]
    out: dict = {"programs": {}, "failures": [f for r in rounds for f in r["failures"]]}
    for p in programs:
        steps = [r["results"][p]["step_ms"] for r in rounds]
        med = statistics.median(steps)
        out["programs"][p] = {"step_ms": _median_range(steps),
                              "first_epoch_s": _median_range([r["results"][p]["first_epoch_s"] for r in rounds]),
                              "peak_rss_mb": statistics.median(r["results"][p]["peak_rss_mb"] for r in rounds),
                              "fit_overhead_share": max(r["results"][p]["fit_overhead_share"] for r in rounds),
                              "outlier_rounds": [i for i, s in enumerate(steps) if s > OUTLIER * med]}
    out["overhead_ok"] = all(v["fit_overhead_share"] < OVERHEAD_MAX for v in out["programs"].values())
    if out["failures"] or "tfdist" not in programs:
        out["ratios"] = None  # a failed check prints no ratio
        return out
    out["reference_per_round"] = [r["reference"] for r in rounds]
    out["ratios"] = {key: _median_range([r["results"]["tfdist"][key] / r["results"][r["reference"]][key]
                                         for r in rounds]) for key in ("step_ms", "first_epoch_s")}
    return out


def run_case(case: dict, programs: list[str], rounds: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = programs[r % len(programs):] + programs[:r % len(programs)]
            results = {}
            for program in order:
                results[program] = run(program, case, os.path.join(tmp, f"{program}.npz"))
                r_ = results[program]
                print(f"  round {r} {program}: " + (f"error {r_['error']}" if "error" in r_ else
                      f"{r_['step_ms']:.0f} ms/step, first epoch {r_['first_epoch_s']:.1f} s"), flush=True)
            ok_jax = [p for p in ("jax", "jax_1thread") if "error" not in results.get(p, {"error": 1})]
            # the reference: the faster JAX setting of this round
            reference = min(ok_jax, key=lambda p: results[p]["step_ms"]) if ok_jax else "jax"
            for program, result in results.items():
                if "error" not in result and "error" not in results.get(reference, {"error": 1}):
                    result["update_rel_diff"] = update_rel_diff(os.path.join(tmp, f"{program}.npz"),
                                                                os.path.join(tmp, f"{reference}.npz"))
            out.append({"results": {p: results[p] for p in programs}, "reference": reference,
                        "failures": check_round(results, reference) if reference in results else ["no JAX run"]})
    return out


def _fmt(d: dict, digits: int = 0) -> str:
    return f"{d['median']:.{digits}f} ({d['range'][0]:.{digits}f}-{d['range'][1]:.{digits}f})"


def markdown(cases: list[dict]) -> str:
    lines = ["| family | workload | size | mesh | tfdist ms | JAX ms | JAX 1-thread ms | tfdist / JAX step "
             "| tfdist / JAX first epoch | checks | measured at |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        s, p = c["summary"], c["summary"]["programs"]
        cells = [_fmt(p[k]["step_ms"]) + (f" outliers {p[k]['outlier_rounds']}" if p[k]["outlier_rounds"] else "")
                 if k in p else "fails or not run" for k in PROGRAMS]
        ratios = s["ratios"]
        checks = "pass" if not s["failures"] else "FAIL: " + "; ".join(s["failures"])[:200]
        if not s["overhead_ok"]:
            checks += " (fit overhead >= 5% of an epoch)"
        lines.append(f"| {c['family']} | {c['workload']} | {c['size']} | {c['mesh'][0]}x{c['mesh'][1]} | "
                     + " | ".join(cells) + " | "
                     + (" | ".join(_fmt(ratios[k], 2) for k in ("step_ms", "first_epoch_s")) if ratios else "- | -")
                     + f" | {checks} | {c.get('commit', '')} {c.get('date', '')} |")
    return "\n".join(lines)


def _key(case: dict) -> tuple:
    return case["family"], case["workload"], case["size"], tuple(case["mesh"]), case.get("devices", "cpu")


def merged_cases(path: str, new: list[dict]) -> list[dict]:
    """``new`` and the cases of the results at ``path`` it does not measure again (``--update``);
    a kept case without its own commit takes the file's (results written before cases kept theirs)."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        measured = {_key(c) for c in new}
        for case in old.get("cases", []):
            if _key(case) not in measured:
                kept.append({"commit": old.get("commit", "unknown"), "command": old.get("command", ""),
                             "date": old.get("date", "unknown"), **case})
    return kept + new


def _commit() -> str:
    """The commit measured; "+uncommitted" when the library or a benchmark script differs from it
    (results files written by an earlier run do not count)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    changed = subprocess.run(["git", "status", "--porcelain", "--", "../tfdist", "*.py"], capture_output=True,
                             text=True, cwd=HERE)
    return (head.stdout.strip() or "unknown") + ("+uncommitted" if changed.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gemma", help=f"one of {FAMILIES}, a comma list, or all")
    parser.add_argument("--workload", default="all", help=f"one of {WORKLOADS}, or all")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--mesh", default="2x4,4x2", help="(batch, model) mesh shapes of 8 devices")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="steps an epoch")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the first")
    parser.add_argument("--one-device", action="store_true", help="also run TF and JAX without a distribution")
    parser.add_argument("--devices", default="cpu", choices=["cpu", "gpu"],
                        help="cpu: 8 virtual CPUs of this host; gpu: the host's GPUs (as many as the mesh's size)")
    parser.add_argument("--out", default="keras_hub_vs_jax", help="results/<out>.json")
    parser.add_argument("--update", action="store_true",
                        help="keep the cases of results/<out>.json this run does not measure (each case records "
                             "its own commit, date and command)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], json.loads(args.worker[1]), args.worker[2])
        return
    sys.path.insert(0, HERE)
    from _common import write_results

    command = " ".join(["python", "benchmarks/keras_hub_vs_jax.py", *sys.argv[1:]])
    families = FAMILIES if args.family == "all" else tuple(args.family.split(","))
    workloads = WORKLOADS if args.workload == "all" else tuple(args.workload.split(","))
    # one XLA thread per device is a CPU setting; on GPUs JAX runs as it comes
    programs = [p for p in PROGRAMS if args.devices == "cpu" or p != "jax_1thread"]
    programs += list(ONE_DEVICE) if args.one_device else []
    cases = []
    for family in families:
        for workload in workloads:
            for mesh in args.mesh.split(","):
                case = dict(family=family, workload=workload, size=args.size, devices=args.devices,
                            mesh=[int(n) for n in mesh.split("x")], steps=args.steps, epochs=args.epochs)
                print(f"{family} {workload} {args.size} {mesh}", flush=True)
                rounds = run_case(case, programs, args.rounds)
                cases.append({**case, "rounds": rounds, "summary": summarize(rounds), "commit": _commit(),
                              "date": time.strftime("%Y-%m-%d"), "command": command})
    if args.update:
        cases = merged_cases(os.path.join(os.environ.get("TFDIST_BENCH_RESULTS", os.path.join(HERE, "results")),
                                          f"{args.out}.json"), cases)
    table = markdown(cases)
    meta = {"command": command if not args.update else "; ".join(sorted({c["command"] for c in cases})),
            "sizes": SIZES, "programs": programs, "loss_rtol": LOSS_RTOL, "update_rtol": UPDATE_RTOL,
            "jax_one_thread_flags": JAX_ONE_THREAD, "cases": cases}
    path = write_results(args.out, [], meta)
    print(table)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
