"""Did a change move the numbers?  compare.py's programs at a base commit and at this tree, interleaved.

    python benchmarks/before_after.py BASE [--programs tfdist_parallelize:W1,tfdist_layout_map:W2] [--rounds 3]
    python benchmarks/before_after.py BASE --hub gemma:backbone:2x4,gemma:lm:2x4 [--rounds 3]

The base commit is checked out into a temporary git worktree; each round runs every program once
from each tree (base first in odd rounds, this tree first in even ones), in fresh processes that
import tfdist from their own tree.  compare.py's worker times the steady steps of Keras ``fit`` and
reports its losses; the two trees' losses must agree (the change kept the computation), and each
program's ratio is the median over rounds of this tree's step time over the base's (``first_ratio``:
the same for the first step, trace and compile included).  ``--hub family:workload:mesh`` pairs run
keras_hub_vs_jax.py's tfdist worker instead (keras-hub models under a layout map, tiny size; the
first figure is its first epoch), and the two trees' weight updates must agree too.  Machine state
moves absolute times between runs (the same commit measured days apart differs by 2-3x here), so
only the interleaved ratio speaks.  Writes ``results/changes/before_after_<base>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import print_table, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)


def _worker(tree: str, program: str, workload: str) -> dict:
    """One run of compare.py's worker, or (``program`` "hub") of keras_hub_vs_jax.py's tfdist
    worker on the case ``workload`` names (family:workload:mesh)."""
    env = dict(os.environ, PYTHONPATH=tree)
    weights = None
    if program == "hub":
        family, hub_workload, mesh = workload.split(":")
        case = dict(family=family, workload=hub_workload, size="tiny", devices="cpu",
                    mesh=[int(n) for n in mesh.split("x")], steps=16, epochs=3)
        weights = os.path.join(tempfile.mkdtemp(), "update.npz")
        command = [os.path.join(tree, "benchmarks", "keras_hub_vs_jax.py"), "--worker", "tfdist", json.dumps(case),
                   weights]
        env = dict(env, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    else:
        command = [os.path.join(tree, "benchmarks", "compare.py"), "--worker", program, workload]
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=tree, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{program} {workload} in {tree} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result.setdefault("first_step_s", result.get("first_epoch_s"))
    result["weights"] = weights
    return result


def _same_updates(a: dict, b: dict) -> bool:
    """Equal weight updates (hub runs: from equal starting weights, relative 1e-3 in norm)."""
    if a["weights"] is None:
        return True
    sys.path.insert(0, HERE)
    from keras_hub_vs_jax import update_rel_diff

    return update_rel_diff(a["weights"], b["weights"]) <= 1e-3


def _same_losses(a: dict, b: dict) -> bool:
    la, lb = a.get("losses") or [], b.get("losses") or []
    return len(la) == len(lb) and all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in zip(la, lb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the commit to compare with (e.g. a commit before the change)")
    parser.add_argument("--programs", default="tfdist_parallelize:W1,tfdist_layout_map:W2",
                        help="compare.py program:workload pairs")
    parser.add_argument("--hub", default="", help="keras-hub cases family:workload:mesh (e.g. gemma:backbone:2x4), "
                        "run through keras_hub_vs_jax.py's tfdist worker instead of --programs")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = subprocess.run(["git", "rev-parse", "--short", args.base], capture_output=True, text=True, cwd=TREE,
                          check=True).stdout.strip()
    head = subprocess.run(["git", "describe", "--always", "--dirty=+uncommitted"], capture_output=True, text=True,
                          cwd=TREE, check=True).stdout.strip()  # the tree measured, which may hold uncommitted work
    pairs = ([("hub", case) for case in args.hub.split(",")] if args.hub
             else [tuple(p.split(":")) for p in args.programs.split(",")])
    with tempfile.TemporaryDirectory() as tmp:
        worktree = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", worktree, base], cwd=TREE, check=True)
        try:
            runs = {pair: {"base": [], "head": []} for pair in pairs}
            for r in range(args.rounds):
                for pair in pairs:
                    order = [("base", worktree), ("head", TREE)]
                    for side, tree in (order if r % 2 == 0 else order[::-1]):
                        result = _worker(tree, *pair)
                        runs[pair][side].append(result)
                        print(f"round {r + 1}/{args.rounds} {pair[0]} {pair[1]} {side}: "
                              f"{result['step_ms']:.1f} ms/step", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=TREE, check=False)
    rows = []
    for (program, workload), sides in runs.items():
        ratios = [h["step_ms"] / b["step_ms"] for b, h in zip(sides["base"], sides["head"])]
        first = [h["first_step_s"] / b["first_step_s"] for b, h in zip(sides["base"], sides["head"])]
        rows.append({
            "program": program, "workload": workload,
            "base_ms": round(statistics.median(r["step_ms"] for r in sides["base"]), 1),
            "head_ms": round(statistics.median(r["step_ms"] for r in sides["head"]), 1),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "base_first_s": round(statistics.median(r["first_step_s"] for r in sides["base"]), 2),
            "head_first_s": round(statistics.median(r["first_step_s"] for r in sides["head"]), 2),
            "first_ratio": round(statistics.median(first), 3),
            "first_ratio_range": [round(min(first), 3), round(max(first), 3)],
            "same_losses": all(_same_losses(b, h) for b, h in zip(sides["base"], sides["head"])),
            "same_updates": all(_same_updates(b, h) for b, h in zip(sides["base"], sides["head"])),
        })
    path = write_results(f"changes/before_after_{base}", rows, {
        "command": "python benchmarks/before_after.py " + " ".join(sys.argv[1:]),
        "base": base, "head": head, "rounds": args.rounds})
    print_table(rows, ["program", "workload", "base_ms", "head_ms", "ratio", "ratio_range", "base_first_s",
                       "head_first_s", "first_ratio", "first_ratio_range", "same_losses", "same_updates"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
