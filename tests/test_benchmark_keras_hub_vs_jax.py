"""benchmarks/keras_hub_vs_jax.py's checks and summary on results written by hand (the benchmark
itself is a command, not a test): a round whose losses or weight update differ from the
reference's prints no ratio; the reference is the faster JAX program; outliers are reported."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "keras_hub_vs_jax.py"
sys.path.insert(0, str(PATH.parent))
spec = importlib.util.spec_from_file_location("keras_hub_vs_jax", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _result(program, step_ms, losses=(2.0, 1.9), update=0.0, first=5.0):
    return {"program": program, "step_ms": step_ms, "first_epoch_s": first, "losses": list(losses),
            "update_rel_diff": update, "peak_rss_mb": 100.0, "fit_overhead_share": 0.01}


def _round(tfdist=200.0, jax=180.0, jax1=160.0, tf_losses=(2.0, 1.9), tf_update=1e-5):
    results = {"tfdist": _result("tfdist", tfdist, tf_losses, tf_update, first=6.0),
               "jax": _result("jax", jax), "jax_1thread": _result("jax_1thread", jax1, first=4.0)}
    reference = min(("jax", "jax_1thread"), key=lambda p: results[p]["step_ms"])
    return {"results": results, "reference": reference, "failures": bench.check_round(results, reference)}


def test_ratios_are_medians_of_per_round_ratios_against_the_faster_jax():
    rounds = [_round(200, 180, 160), _round(150, 140, 170), _round(400, 200, 200)]
    summary = bench.summarize(rounds)
    assert [r["reference"] for r in rounds] == ["jax_1thread", "jax", "jax"]
    # per round: 200/160, 150/140, 400/200
    assert summary["ratios"]["step_ms"]["median"] == pytest.approx(1.25)
    assert summary["ratios"]["step_ms"]["range"] == [pytest.approx(150 / 140), pytest.approx(2.0)]
    assert summary["programs"]["tfdist"]["outlier_rounds"] == [2]  # 400 > 1.3 x 200: kept and reported
    assert summary["programs"]["tfdist"]["step_ms"]["median"] == 200


@pytest.mark.parametrize("bad", [dict(tf_losses=(2.0, 1.8)), dict(tf_update=0.05)])
def test_a_failed_check_in_any_round_prints_no_ratio(bad):
    rounds = [_round(), _round(**bad), _round()]
    assert rounds[1]["failures"] and not rounds[0]["failures"]
    summary = bench.summarize(rounds)
    assert summary["ratios"] is None
    table = bench.markdown([{"family": "gemma", "workload": "lm", "size": "tiny", "mesh": [2, 4],
                             "summary": summary}])
    assert "| - | - | FAIL: tfdist:" in table


def test_a_failed_run_is_a_failure_not_a_ratio():
    rounds = [_round(), _round()]
    rounds[1]["results"]["tfdist"] = {"program": "tfdist", "error": "InvalidArgumentError: boom"}
    rounds[1]["failures"] = bench.check_round(rounds[1]["results"], rounds[1]["reference"])
    summary = bench.summarize(rounds)
    assert summary["ratios"] is None and "tfdist: InvalidArgumentError: boom" in summary["failures"]


def test_the_update_check_compares_updates_not_weights(tmp_path):
    ref = [np.full((4, 4), 0.01, "float32"), np.full(3, -0.02, "float32")]
    np.savez(tmp_path / "ref.npz", *ref)
    np.savez(tmp_path / "same.npz", *[r * (1 + 1e-4) for r in ref])
    np.savez(tmp_path / "scaled.npz", *[r / 8 for r in ref])  # a gradient 1/8 of the right one
    assert bench.update_rel_diff(tmp_path / "same.npz", tmp_path / "ref.npz") == pytest.approx(1e-4, rel=1e-2)
    assert bench.update_rel_diff(tmp_path / "scaled.npz", tmp_path / "ref.npz") == pytest.approx(7 / 8)


def test_update_keeps_the_cases_not_measured_again_with_their_own_commit(tmp_path):
    import json

    def case(family, mesh, commit=None):
        out = {"family": family, "workload": "lm", "size": "tiny", "mesh": mesh, "summary": {}}
        return {**out, "commit": commit} if commit else out

    path = tmp_path / "old.json"
    path.write_text(json.dumps({"commit": "aaa", "command": "old run", "date": "2026-12-01",
                                "cases": [case("gemma", [2, 4]), case("llama", [2, 4]), case("gemma", [4, 2], "bbb")]}))
    merged = bench.merged_cases(str(path), [case("gemma", [2, 4], "new")])
    assert [(c["family"], c["mesh"], c["commit"]) for c in merged] == [
        ("llama", [2, 4], "aaa"), ("gemma", [4, 2], "bbb"), ("gemma", [2, 4], "new")]
    assert merged[0]["command"] == "old run" and merged[0]["date"] == "2026-12-01"
    assert bench.merged_cases(str(tmp_path / "none.json"), [case("gemma", [2, 4], "new")])[0]["commit"] == "new"
