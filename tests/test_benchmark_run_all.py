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


def test_meets_reads_the_target():
    assert run_all.meets(1.0, "<= 1.0") == "yes" and run_all.meets(1.01, "<= 1.0") == "**no**"
    assert run_all.meets(0.101, "< 0.10") == "**no**" and run_all.meets(0.0, "0") == "yes"
    assert run_all.meets("23 of 34", "") == "" and run_all.meets(1.2, "") == ""


def test_performance_docs_quote_the_committed_results_table():
    """docs/performance.md's headline table is `run_all.py --report-only` over the committed results,
    word for word: a result committed without regenerating the table fails here."""
    table = run_all.markdown(run_all.report_only(BENCH / "results", run_all.BENCHMARKS))
    assert "failed:" not in table
    assert table.strip() in (BENCH.parent / "docs" / "performance.md").read_text()


def test_every_committed_result_is_in_the_index():
    """benchmarks/results/README.md names every committed file at its top level (current results),
    and every file it names exists; one-off runs live in changes/ or archive/."""
    import re
    import shutil
    import subprocess

    if shutil.which("git") is None or not (BENCH.parent / ".git").exists():
        pytest.skip("needs the git checkout (the committed files)")
    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=BENCH.parent, capture_output=True,
                            text=True, check=True).stdout.split()
    top = {p.split("/", 2)[2] for p in listed if p.count("/") == 2 and not p.rsplit("/", 1)[1].startswith(".")}
    top -= {"README.md"}
    index = (BENCH / "results" / "README.md").read_text()
    named = {n for row in index.splitlines() if row.startswith("| `")
             for n in re.findall(r"`([\w.]+)`", row.split("|")[1])}
    assert top - named == set(), "results not in benchmarks/results/README.md"
    assert named - top == set(), "the index names files that are not committed"


def test_readme_quotes_the_targets_of_the_committed_results_and_fits_its_budget():
    """The README's targets table is `run_all.py --report-only`'s, word for word, and the README
    stays a first screen plus one short example per part (issue budget: 200 lines, 15 a example)."""
    import re

    readme = (BENCH.parent / "README.md").read_text()
    table = run_all.targets_markdown(run_all.report_only(BENCH / "results", run_all.BENCHMARKS))
    assert table.strip() in readme
    assert len(readme.splitlines()) <= 200
    assert all(len(code.splitlines()) <= 15 for code in re.findall(r"```python\n(.*?)```", readme, re.S))


def test_report_only_rewrites_the_tables_between_their_markers(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("intro\n<!-- run_all:targets -->\nold\n<!-- /run_all:targets -->\nend\n")
    (tmp_path / "docs" / "performance.md").write_text("x\n<!-- run_all:headline -->\n<!-- /run_all:headline -->\n")
    report = {"meta": {"report_only": True}, "benchmarks": [
        {"benchmark": "b", "headline": [{"what": "w", "value": 1.5, "target": "<= 1.0"}]}]}
    assert run_all.write_doc_tables(report, tmp_path) == ["README.md", "docs/performance.md"]
    readme = (tmp_path / "README.md").read_text()
    assert "| b | 0 of 1 | w: 1.5 (<= 1.0) |" in readme and "old" not in readme and readme.endswith("end\n")
    assert "| b | w | 1.5 | <= 1.0 | **no** |" in (tmp_path / "docs" / "performance.md").read_text()
    assert run_all.write_doc_tables(report, tmp_path) == []  # current: nothing written
    (tmp_path / "README.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="README.md has no <!-- run_all:targets -->"):
        run_all.write_doc_tables(report, tmp_path)
