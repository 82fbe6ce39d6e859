"""benchmarks/run_all.py: every benchmark is registered, and each headline reads the committed results."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # as `python benchmarks/run_all.py` has it
spec = importlib.util.spec_from_file_location("run_all", BENCH / "run_all.py")
run_all = importlib.util.module_from_spec(spec)
sys.modules["run_all"] = run_all  # its dataclass looks its module up by name
spec.loader.exec_module(run_all)


def test_every_benchmark_script_is_run_except_the_commit_comparison():
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")} - {"run_all.py"}
    registered = {b.script for b in run_all.BENCHMARKS}
    assert scripts - registered == {"before_after.py"}  # it needs a commit to compare with (see run_all)
    assert registered <= scripts


@pytest.mark.parametrize("bench", run_all.BENCHMARKS, ids=lambda b: b.name)
def test_headline_reads_the_committed_results(bench):
    data = json.loads((BENCH / "results" / bench.result).read_text())
    rows = bench.headline(data)
    assert rows and all(isinstance(what, str) and what for what, _, _ in rows)
    assert all(isinstance(value, (int, float, str)) for _, value, _ in rows)


def test_markdown_names_the_command_commit_and_failures():
    report = {"meta": {"command": "python benchmarks/run_all.py --quick", "commit": "abc1234", "date": "2026-11-27",
                       "machine": {"cpus": 2, "platform": "Linux", "tensorflow": "2.21.0"}},
              "benchmarks": [{"benchmark": "pipeline", "headline": [{"what": "compute", "value": 1.0,
                                                                      "target": "<= 1.05"}]},
                             {"benchmark": "fsdp", "error": "RuntimeError: boom"}]}
    table = run_all.markdown(report)
    assert "`python benchmarks/run_all.py --quick` at commit `abc1234`" in table
    assert "| pipeline | compute | 1.0 | <= 1.05 |" in table and "| fsdp | failed: RuntimeError: boom | | |" in table
