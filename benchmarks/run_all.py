"""Every benchmark in one command, and one table of the headline ratios.

    python benchmarks/run_all.py            # every benchmark as committed (about an hour or more here)
    python benchmarks/run_all.py --quick    # the headline benchmarks, one round each: minutes, a smoke test
    python benchmarks/run_all.py --only pipeline,checkpoint

Each benchmark runs in its own process, one after another (they time things, so never two at once).
A full run writes the benchmarks' own JSON files in ``benchmarks/results/`` (the files docs/performance.md
quotes) plus ``results/run_all.json`` and ``results/run_all.md``: the headline ratios with the commit and the
machine.  ``--quick`` runs the headline benchmarks (``in_quick``) with one round and few steps, the
comparison with fewer programs, and writes everything under ``results/quick/`` so a short run never
replaces the full one; the diagnostic benchmarks (where a step's time goes, host overheads) need a full run.
A benchmark that fails is reported in the table with its last error line; the others still run.

``before_after.py`` is not run here: it compares two commits, which a run of one checkout cannot choose.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from typing import Callable

HERE = pathlib.Path(__file__).resolve().parent
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads (for its version in the report)
Headline = list[tuple[str, float | str, str]]  # (what, value, target or "")


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    result: str  # the JSON file it writes
    headline: Callable[[dict], Headline]
    env_rounds: tuple[str, str] | None = None  # (full, quick) ROUNDS for scripts that read it from the environment
    in_quick: bool = True  # --quick runs the headline benchmarks only; the diagnostic ones need a full run


def _compare(d: dict) -> Headline:
    rows = []
    for r in d["ratios"]:
        for w in ("W1", "W2"):
            if isinstance(r.get(w), (int, float)):
                rows.append((f"{r['ratio']} ({w})", r[w], f"<= {r['goal']}" if r.get("goal") else ""))
    return rows


def _keras_hub(d: dict) -> Headline:
    rows = []
    for c in d["cases"]:
        what = f"keras-hub {c['family']} {c['workload']} ({c['size']}, {c['mesh'][0]}x{c['mesh'][1]})"
        ratios = c["summary"]["ratios"]
        if ratios is None:  # a failed check prints no ratio
            rows.append((f"{what}: step, tfdist / Keras on JAX", "check failed", "<= 1.0"))
            continue
        rows += [(f"{what}: step, tfdist / Keras on JAX (the faster of its two settings)",
                  round(ratios["step_ms"]["median"], 3), "<= 1.0"),
                 (f"{what}: first epoch, tfdist / Keras on JAX", round(ratios["first_epoch_s"]["median"], 3), "<= 1.2")]
    return rows


def _pipeline(d: dict) -> Headline:
    rows = [(f"pipeline {r['program']}: compute vs one device", r["compute vs one device"],
             "" if "recompute" in r["program"] else "<= 1.05")
            for r in d["rows"] if r.get("compute vs one device") not in ("", None) and r["program"] != "one device"]
    for b in d["bubbles"]:
        if b["p"] == 4 and b["m"] == 8:
            rows.append((f"pipeline {b['schedule']} bubble, p=4 m=8 (theory {b['theory (p-1)/(m+p-1)']})",
                         b["bubble"], ""))
    for e in d.get("executed bubbles", []):
        if e["m"] == 8:
            rows.append((f"pipeline {e['schedule']} executed bubble - plan with measured costs, p=4 m=8",
                         e["executed - plan, measured costs"], "<= 0.05"))
    for c in d.get("across clients", []):
        if c["boundary transfer"] == "shard-wise":
            rows.append((f"pipeline {c['schedule']} across 4 clients: boundary bytes / torch's", c["vs torch"],
                         "<= 1.0"))
    return rows


def _fsdp(d: dict) -> Headline:
    held = [(f"FSDP over {r['N']}: memory held / (total / N)", r["held / (total/N)"], "")
            for r in d["rows"] if isinstance(r.get("N"), int) and r["N"] > 1 and "held / (total/N)" in r][:3]
    hsdp = [r for r in d["rows"] if str(r.get("program", "")).startswith("hsdp")]
    by_program = {r["program"]: r for r in d["rows"] if "program" in r}
    offload = []
    if "fsdp + cpu offload" in by_program and "on devices between steps MB" in by_program["fsdp + cpu offload"]:
        row = by_program["fsdp + cpu offload"]
        offload = [("FSDP + CPU offload: params + optimizer MB on the devices between steps",
                    row["on devices between steps MB"], "0"),
                   ("FSDP + CPU offload: step time / FSDP's", round(row["step ms"] / by_program["fsdp"]["step ms"], 3),
                    "")]
    return held + [(f"HSDP {r['program'].split()[-1]}: bytes sent per step / torch's plan", r["sent / torch's plan"],
                    "<= 1.0") for r in hsdp] + offload


def _fsdp_accumulation(d: dict) -> Headline:
    return [(f"FSDP accumulation, {r['accumulation (4 micro-batches)']}: reduce-scatter bytes vs syncing each",
             r["RS bytes vs sync each"], "") for r in d["rows"] if "RS bytes vs sync each" in r]


def _local_sgd(d: dict) -> Headline:
    return [(f"{r['program']}: step time vs raw TF DTensor data parallel", r["vs TF DTensor data parallel"],
             "<= 1.05" if r["program"] == "DDP (sync)" else "")
            for r in d["rows"] if r["program"] != "TF DTensor data parallel"]


def _ratios_dict(prefix: str) -> Callable[[dict], Headline]:
    """Every numeric ratio; a key that names its target, ``"x (target <= 1.2)"``, gets it as the target."""
    def rows(d: dict) -> Headline:
        out = []
        for key, value in d["ratios"].items():
            if isinstance(value, (int, float)):
                named = re.fullmatch(r"(.*?)\s*\(target ([^)]*)\)", key)
                out.append((prefix + (named.group(1) if named else key), value, named.group(2) if named else ""))
        return out

    return rows


def _distributions(d: dict) -> Headline:
    return [(f"distributions {r['distribution']}.{r['op']}: tfdist / TFP", r["ratio"], "") for r in d["rows"]]


def _redistribute(d: dict) -> Headline:
    ratios = [r["bytes_vs_torch"] for r in d["rows"] if isinstance(r.get("bytes_vs_torch"), (int, float))]
    return [(f"redistribute: bytes vs torch's plan, worst of {len(ratios)} moves", max(ratios), "<= 1.0"),
            ("redistribute: moves at torch's bytes", f"{sum(r <= 1.0 for r in ratios)} of {len(ratios)}", "")]


def _plain(d: dict) -> Headline:
    rows = []
    for r in d["rows"]:
        if r["program"] != "plain":
            for k, v in r.items():
                if k.endswith("_ratio"):
                    rows.append((f"plain TF/Keras code with {r['program']}: {k[:-6]} time / without", v, "<= 1.05"))
    return rows


def _all_reduce(d: dict) -> Headline:
    return [("TF DTensor all-reduce / MirroredStrategy's (time)", round(d["ratio_dtensor_over_mirrored"], 3), "")]


def _per_device_xla(d: dict) -> Headline:
    names = {("block", "local_map_xla"): "gelu block step, local_map(jit_compile=True) / plain TF DTensor",
             ("gemma", "jit_true"): "keras-hub Gemma data-parallel step, jit_compile=True / False (CPU)"}
    return [(names[(r["workload"], r["program"])], r.get("step_vs_tf_dtensor", r.get("step_vs_jit_false")), "")
            for r in d["rows"] if (r["workload"], r["program"]) in names]


def _fit_host_cost(d: dict) -> Headline:
    return [(f"fit step / hand-written step, {k} ({d['workload']})", round(v, 3), "<= 1.0")
            for k, v in d["paired_ratios"].items() if k in ("fit/hand wall_ms", "fit/hand cpu_ms")]


def _gpt_plan(d: dict) -> Headline:
    key = next(k for k in d if k.startswith("parallelize_gpt/layout_map"))
    return [("W2 step: parallelize_gpt / LayoutMap", round(d[key], 3), "")]


def _loss_reduction(d: dict) -> Headline:
    return [(f"loss reduction, tfdist's mean / Keras' sum (time), {setting}",
             round(r["ratio tfdist_mean/keras_sum (median of per-round ratios)"], 3), "<= 1.0")
            for setting, r in d["results"].items()]


def _step_alone(d: dict) -> Headline:
    return [(f"step program alone, {k} ({d['workload']}, wall)", round(v["wall_ms"], 3), "<= 1.0")
            for k, v in d["ratios (median of per-round ratios)"].items()]


def _embedding(d: dict) -> Headline:
    return [(f"embedding: {r['program']} / one-hot matmul (time)", r["vs_one_hot"], "") for r in d["rows"]
            if r["vs_one_hot"] != 1.0]


BENCHMARKS = [
    Benchmark("compare", "compare.py", ("--rounds", "6"),
              ("--rounds", "1", "--workloads", "W1", "--programs",
               "hand_written,tfdist_parallelize,tfdist_layout_map,tfdist_data_parallel,mirrored"),
              "compare.json", _compare),
    Benchmark("keras_hub_vs_jax", "keras_hub_vs_jax.py", ("--family", "gemma,llama"),
              ("--rounds", "1", "--steps", "4", "--epochs", "1", "--mesh", "2x4"), "keras_hub_vs_jax.json", _keras_hub),
    Benchmark("pipeline", "pipeline.py", (), (), "pipeline.json", _pipeline, ("5", "1")),
    Benchmark("fsdp", "fsdp.py", (), (), "fsdp.json", lambda d: _fsdp(d) + _fsdp_accumulation(d), ("5", "1")),
    Benchmark("local_sgd", "local_sgd.py", (), (), "local_sgd.json", _local_sgd, ("5", "1")),
    Benchmark("checkpoint", "checkpoint.py", (), (), "checkpoint.json", _ratios_dict("checkpoint "), ("5", "1")),
    Benchmark("tp_transformer", "tp_transformer.py", (), ("--rounds", "1", "--steps", "5"), "tp_transformer.json",
              _ratios_dict("TP transformer ")),
    Benchmark("redistribute", "redistribute.py", (), ("--rounds", "1", "--n", "256"), "redistribute.json",
              _redistribute),
    Benchmark("distributions", "distributions.py", (), (), "distributions.json", _distributions),
    Benchmark("plain_code_overhead", "plain_code_overhead.py", (), ("--rounds", "1", "--calls", "300"),
              "plain_code_overhead.json", _plain, in_quick=False),
    Benchmark("all_reduce_cpu", "all_reduce_cpu.py", (), ("--rounds", "1"), "all_reduce_cpu.json", _all_reduce,
              in_quick=False),
    Benchmark("embedding_lookup", "embedding_lookup.py", (), ("--rounds", "1", "--steps", "3"),
              "embedding_lookup.json", _embedding, in_quick=False),
    Benchmark("fit_host_cost", "fit_host_cost.py", (), ("--rounds", "1", "--steps", "5"), "fit_host_cost.json",
              _fit_host_cost, in_quick=False),
    Benchmark("gpt_plan_program", "gpt_plan_program.py", (), ("--rounds", "1", "--steps", "3"),
              "gpt_plan_program.json", _gpt_plan, in_quick=False),
    Benchmark("loss_reduction", "loss_reduction.py", (), ("--rounds", "1", "--steps", "3"), "loss_reduction.json",
              _loss_reduction, in_quick=False),
    Benchmark("step_program_alone", "step_program_alone.py", (), ("--rounds", "1", "--steps", "5"),
              "step_program_alone_W2.json", _step_alone, in_quick=False),
    Benchmark("per_device_xla", "per_device_xla.py", (), ("--rounds", "1"), "per_device_xla.json",
              _per_device_xla, in_quick=False),
]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> dict:
    import tensorflow as tf  # the version only; the benchmarks run in their own processes

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "tensorflow": tf.__version__}


def run_one(bench: Benchmark, quick: bool, results: pathlib.Path, timeout: float) -> dict:
    """Runs one benchmark script; returns its headline rows, or the error that stopped it."""
    env = {**os.environ, "TFDIST_BENCH_RESULTS": str(results), "TF_CPP_MIN_LOG_LEVEL": "3"}
    if bench.env_rounds:
        env["ROUNDS"] = bench.env_rounds[1 if quick else 0]
    command = [sys.executable, str(HERE / bench.script), *(bench.quick if quick else bench.full)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        failed = done.returncode != 0 and (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout:.0f} s"
    seconds = round(time.perf_counter() - start, 1)
    entry = {"benchmark": bench.name, "command": " ".join(["python", f"benchmarks/{bench.script}",
                                                           *(bench.quick if quick else bench.full)]),
             "seconds": seconds, "result": str(results / bench.result)}
    if failed:
        return {**entry, "error": failed}
    return _with_headline(bench, results, entry)


def _with_headline(bench: Benchmark, results: pathlib.Path, entry: dict) -> dict:
    """``entry`` with the headline rows read from the benchmark's JSON, or the reason they could not be."""
    try:
        data = json.loads((results / bench.result).read_text())
        entry["headline"] = [{"what": w, "value": v, "target": t} for w, v, t in bench.headline(data)]
    except (OSError, KeyError, ValueError, StopIteration, TypeError) as e:
        entry["error"] = f"could not read {bench.result}: {type(e).__name__}: {e}"
    return entry


def report_one(bench: Benchmark, results: pathlib.Path) -> dict:
    """The headline of a benchmark from the results it already wrote (``--report-only``)."""
    entry = {"benchmark": bench.name, "command": "", "seconds": 0.0,
             "result": os.path.relpath(results / bench.result, HERE.parent)}
    return _with_headline(bench, results, entry)


def meets(value: float | str, target: str) -> str:
    """"yes" or "no" for a numeric value against a target such as ``<= 1.05``; "" where either is
    not a number or there is no target."""
    match = re.fullmatch(r"\s*(<=|<|>=|>|=)?\s*(-?[\d.]+)\s*", target or "")
    if not match or not isinstance(value, (int, float)):
        return ""
    op, bound = match.group(1) or "=", float(match.group(2))
    ok = {"<=": value <= bound, "<": value < bound, ">=": value >= bound, ">": value > bound, "=": value == bound}[op]
    return "yes" if ok else "**no**"


def markdown(report: dict) -> str:
    meta = report["meta"]
    if meta.get("report_only"):
        source = ("Headline ratios of each benchmark's committed results (`python benchmarks/run_all.py "
                  "--report-only`; each JSON records its host and command)")
    else:
        source = (f"Headline ratios, `{meta['command']}` at commit `{meta['commit']}` on {meta['machine']['cpus']} "
                  f"CPUs ({meta['machine']['platform']}, TF {meta['machine']['tensorflow']})")
    lines = [source + "; lower is better unless a target says otherwise.", "",
             "| benchmark | what | value | target | met |", "| --- | --- | --- | --- | --- |"]
    for entry in report["benchmarks"]:
        if "error" in entry:
            lines.append(f"| {entry['benchmark']} | failed: {entry['error'][:160]} | | | |")
        for row in entry.get("headline", []):
            lines.append(f"| {entry['benchmark']} | {row['what']} | {row['value']} | {row['target']} | "
                         f"{meets(row['value'], row['target'])} |")
    return "\n".join(lines) + "\n"


def targets_markdown(report: dict) -> str:
    """Per benchmark, how many of its targets are met and which are not (the README's table)."""
    lines = ["| benchmark | targets met | not met: value (target) |", "| --- | --- | --- |"]
    for entry in report["benchmarks"]:
        if "error" in entry:
            lines.append(f"| {entry['benchmark']} | failed | {entry['error'][:120]} |")
            continue
        rows = [r for r in entry.get("headline", []) if meets(r["value"], r["target"])]
        if not rows:
            continue
        missed = [r for r in rows if meets(r["value"], r["target"]) != "yes"]
        lines.append(f"| {entry['benchmark']} | {len(rows) - len(missed)} of {len(rows)} | "
                     + "; ".join(f"{r['what']}: {r['value']} ({r['target']})" for r in missed) + " |")
    return "\n".join(lines) + "\n"


# where --report-only writes its tables: (file, marker name, table)
DOC_TABLES = (("README.md", "targets", targets_markdown), ("docs/performance.md", "headline", markdown))


def write_doc_tables(report: dict, root: pathlib.Path = HERE.parent) -> list[str]:
    """Replaces each table between ``<!-- run_all:<name> -->`` and ``<!-- /run_all:<name> -->`` in
    the docs with the report's; returns the files changed."""
    changed = []
    for name, marker, render in DOC_TABLES:
        path = root / name
        text = path.read_text()
        start, end = f"<!-- run_all:{marker} -->\n", f"<!-- /run_all:{marker} -->"
        if start not in text or end not in text:
            raise ValueError(f"{name} has no {start.strip()} ... {end} markers for run_all's table")
        head, rest = text.split(start, 1)
        new = head + start + render(report) + end + rest.split(end, 1)[1]
        if new != text:
            path.write_text(new)
            changed.append(name)
    return changed


def report_only(results: pathlib.Path, chosen: list[Benchmark]) -> dict:
    """The report of the results already written, run by nobody now: deterministic, so docs can
    quote it and a test can check they still do."""
    return {"meta": {"command": "python benchmarks/run_all.py --report-only", "report_only": True},
            "benchmarks": [report_one(bench, results) for bench in chosen]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps; results under results/quick/")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each benchmark may take")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild the tables from the results already written (and the "
                             "README's and docs/performance.md's copies of them)")
    args = parser.parse_args(argv)
    known = {b.name for b in BENCHMARKS}
    only = [n for n in args.only.split(",") if n]
    if set(only) - known:
        parser.error(f"--only names unknown benchmarks {sorted(set(only) - known)}; known: {sorted(known)}")
    chosen = [b for b in BENCHMARKS if (b.name in only if only else b.in_quick or not args.quick)]
    results = HERE / "results" / ("quick" if args.quick else "")
    results.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        report = report_only(results, chosen)
        if not args.quick and not only:
            print("docs rewritten:", ", ".join(write_doc_tables(report)) or "none (already current)")
    else:
        report = {"meta": {"command": "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
                           + (f" --only {args.only}" if only else ""), "commit": _commit(), "machine": _machine(),
                           "date": time.strftime("%Y-%m-%d")}, "benchmarks": []}
        for bench in chosen:
            print(f"-- {bench.name} ...", flush=True)
            entry = run_one(bench, args.quick, results, args.timeout)
            report["benchmarks"].append(entry)
            print(f"   {entry['seconds']} s" + (f", FAILED: {entry['error']}" if "error" in entry else ""), flush=True)
    (results / "run_all.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (results / "run_all.md").write_text(table)
    (results / "run_all_targets.md").write_text(targets_markdown(report))
    print("\n" + table)
    print(f"wrote {results / 'run_all.json'}, {results / 'run_all.md'} and run_all_targets.md")
    return 1 if any("error" in e for e in report["benchmarks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
