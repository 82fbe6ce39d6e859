"""benchmarks/compare.py's bookkeeping: medians over rounds, the loss check against one device,
the goal ratios and the Markdown table -- on results written by hand (the benchmark itself is
a command, not a test)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "compare.py"
sys.path.insert(0, str(PATH.parent))  # as `python benchmarks/compare.py` has it: the script imports _common
spec = importlib.util.spec_from_file_location("compare", PATH)
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def _run(step_ms, losses, rss=100.0):
    return {"step_ms": step_ms, "first_step_s": 2.0, "fit_return_s": 0.1, "peak_rss_mb": rss, "losses": losses}


RUNS = {"W1": {
    "one_device": [_run(10, [1.0, 0.9]), _run(12, [1.0, 0.9]), _run(11, [1.0, 0.9])],
    "hand_written": [_run(20, [1.0, 0.9]), _run(22, [1.0, 0.9]), _run(30, [1.0, 0.9])],
    "tfdist_parallelize": [_run(21, [1.0, 0.9001]), _run(23, [1.0, 0.9]), _run(24, [1.0, 0.9])],
    "tfdist_data_parallel": [_run(40, [1.0, 0.95], rss=90), _run(40, [1.0, 0.95], rss=90)],
    "mirrored": [_run(50, [1.0, 0.9], rss=120)],
    "tf_keras_layout_map": [{"error": "ValueError: no", "peak_rss_mb": 80}],
}}


def test_medians_and_the_loss_check_against_one_device():
    summary = compare.summarize(RUNS)["W1"]
    assert summary["hand_written"]["step_ms"] == 22
    assert summary["tfdist_parallelize"]["step_ms"] == 23
    assert summary["tfdist_parallelize"]["losses_agree"] is True  # 1.1e-4 relative: within 1e-3
    assert summary["tfdist_data_parallel"]["losses_agree"] is False  # 0.95 vs 0.9
    assert summary["tfdist_data_parallel"]["loss_rel_diff"] == pytest.approx(0.05 / 0.9)
    assert summary["tf_keras_layout_map"] == {"error": "ValueError: no", "peak_rss_mb": 80}


def test_goal_ratios_pair_the_programs_of_each_round_and_table():
    summary = compare.summarize(RUNS)
    rows = {r["ratio"]: r for r in compare.ratios(RUNS)}
    tp = rows["tfdist parallelize_module fit 2x4 / hand-written TF DTensor 2x4"]
    # rounds: 21/20, 23/22, 24/30 -> median 23/22 (not the ratio of medians, 23/22 by chance here too)
    assert tp["W1"] == pytest.approx(23 / 22, abs=1e-3)
    assert tp["W1_range"] == [pytest.approx(0.8), pytest.approx(1.05)]
    # its losses differ from one device's: no ratio, and the table says why
    assert rows["tfdist DataParallel fit 8 / MirroredStrategy fit 8"]["W1"] is None
    assert rows["tfdist DataParallel fit 8 / MirroredStrategy fit 8"]["W1_check"] == (
        "losses differ from one device: tfdist_data_parallel")
    assert rows["peak memory: tfdist DataParallel / MirroredStrategy"]["W1"] is None
    assert rows["tfdist parallelize_module fit 2x4 / tf_keras LayoutMap fit 2x4"]["W1"] is None  # it failed
    table = compare.markdown(summary, compare.ratios(RUNS), {"command": "c", "commit": "abc", "rounds": 3})
    assert "| tf_keras_layout_map | fails: ValueError: no |" in table
    assert "| tfdist_data_parallel | 40.0 | 2.0 | 0.10 | 90 | no (5.6e-02) |" in table
    assert "| tfdist DataParallel fit 8 / MirroredStrategy fit 8 | <= 1.00 | losses differ from one device" in table
    fixed = {"W1": dict(RUNS["W1"], tfdist_data_parallel=[_run(40, [1.0, 0.9], rss=90)] * 2)}
    rows = {r["ratio"]: r for r in compare.ratios(fixed)}
    assert rows["tfdist DataParallel fit 8 / MirroredStrategy fit 8"]["W1"] == pytest.approx(0.8)  # one paired round
    assert rows["peak memory: tfdist DataParallel / MirroredStrategy"]["W1"] == pytest.approx(0.75)


def test_every_round_is_checked_against_that_round_s_one_device():
    """A program right in its first round and wrong in its third has no ratio (was: only the first
    round was checked, and the ratio printed)."""
    runs = {"W1": {"one_device": [_run(10, [1.0, 0.9])] * 3,
                   "hand_written": [_run(20, [1.0, 0.9])] * 3,
                   "tfdist_parallelize": [_run(21, [1.0, 0.9]), _run(21, [1.0, 0.9]), _run(21, [1.0, 0.5])]}}
    summary = compare.summarize(runs)["W1"]["tfdist_parallelize"]
    assert summary["losses_agree"] is False and summary["loss_rel_diff"] == pytest.approx(0.4 / 0.9)
    row = next(r for r in compare.ratios(runs) if r["ratio"].startswith("tfdist parallelize_module fit 2x4 / hand-written TF"))
    assert row["W1"] is None


def test_a_run_without_one_device_has_no_loss_check_and_still_tabulates():
    runs = {"W2": {p: RUNS["W1"][p] for p in ("hand_written", "tfdist_parallelize")}}
    summary = compare.summarize(runs)
    assert summary["W2"]["hand_written"]["losses_agree"] is None
    table = compare.markdown(summary, compare.ratios(runs), {"command": "c", "commit": "abc", "rounds": 3})
    assert "| hand_written | 22.0 | 2.0 | 0.10 | 100 | no one_device run |" in table


def test_a_round_ratio_is_not_the_ratio_of_medians():
    runs = {"W1": {"tfdist_parallelize": [_run(10, [1.0]), _run(30, [1.0]), _run(12, [1.0])],
                   "hand_written": [_run(10, [1.0]), _run(10, [1.0]), _run(20, [1.0])]}}
    row = next(r for r in compare.ratios(runs) if r["ratio"].startswith("tfdist parallelize_module fit 2x4 / hand-written TF"))
    assert row["W1"] == pytest.approx(1.0)  # rounds: 1.0, 3.0, 0.6 (the ratio of medians would be 12/10)


def test_losses_logged_every_few_steps_are_checked_at_those_steps():
    reference = _run(10, [4.0, 3.0, 2.0, 1.0])
    every_two = dict(_run(10, [3.0, 1.0005]), loss_steps=[1, 3])  # steps_per_execution=2
    wrong = dict(_run(10, [2.0, 1.0]), loss_steps=[1, 3])
    summary = compare.summarize({"W1": {"one_device": [reference], "tfdist_parallelize_spe4": [every_two],
                                        "tfdist_parallelize": [wrong]}})["W1"]
    assert summary["tfdist_parallelize_spe4"]["losses_agree"] is True
    assert summary["tfdist_parallelize"]["loss_rel_diff"] == pytest.approx(1 / 3)


W1_STEPS = {"warmup": 10, "steps": 100}


def _marked(clock, times, cpu_per_step=0.040):
    clock.start = 0.0
    clock.marks = {i: (t, 1.0) for i, t in times.items()}
    clock.cpu = {i: i * cpu_per_step for i in times}
    return clock.report(returned=times[max(times)] + 0.5, running_mean=True)


def test_a_step_time_is_the_median_blocks_and_the_window_keeps_the_burst():
    clock = compare._Clock(W1_STEPS)
    assert clock.sync_at == {0, 9, 39, 69, 99}  # the blocks' ends are synchronised: their times are real
    # steps 10-39 take 20 ms, 40-69 take 50 ms (a burst from elsewhere), 70-99 take 30 ms
    per_step = {i: 0.020 if i <= 39 else 0.050 if i <= 69 else 0.030 for i in range(100)}
    times, t = {}, 0.0
    for i in range(100):
        t += per_step[i]
        times[i] = t
    report = _marked(clock, times)
    assert report["block_ms"] == [pytest.approx(20), pytest.approx(50), pytest.approx(30)]
    assert report["step_ms"] == pytest.approx(30)
    assert report["window_ms"] == pytest.approx((30 * 20 + 30 * 50 + 30 * 30) / 90)
    assert report["fit_return_s"] == pytest.approx(0.5)
    assert report["cpu_ms"] == pytest.approx(40)  # process CPU per step over the timed window


def test_marks_every_few_steps_end_the_blocks_at_the_first_mark_from_each_bound():
    clock = compare._Clock(W1_STEPS)
    marked = {i: i * 0.01 for i in range(3, 100, 4)}  # steps_per_execution=4: steps 3, 7, ..., 99
    report = _marked(clock, marked)
    assert clock.block_ends() == [11, 39, 71, 99]
    assert report["step_ms"] == pytest.approx(10)


def test_marks_every_few_steps_synchronise_where_blocks_end(monkeypatch):
    """A mark between synchronisations is a dispatch time; the blocks must end at real ones."""
    synced = []
    monkeypatch.setattr(compare, "_scalar", synced.append)
    clock = compare._Clock(W1_STEPS)
    for i in range(3, 100, 4):  # steps_per_execution=4
        clock.step_done(i, i)
    assert synced == [3, 11, 39, 71, 99]  # the first mark, then the first at or after 9, 39, 69, 99
    assert set(clock.block_ends()) <= set(synced)


def test_the_run_s_final_mark_ends_no_block_when_the_tail_follows_it():
    """Keras on a mesh marks a step after dispatching the next, except the epoch's final step:
    ending the last block there would flatter it, so the tail's steps end no block."""
    clock = compare._Clock(W1_STEPS)
    times = {i: i * 0.02 for i in range(100 + compare.TAIL_STEPS)}
    times[100 + compare.TAIL_STEPS - 1] -= 0.015  # the final mark comes without the lag
    report = _marked(clock, times)
    assert clock.block_ends() == [9, 39, 69, 99]
    assert report["block_ms"] == [pytest.approx(20)] * 3
    assert report["fit_return_s"] == pytest.approx(0.5)  # from the final mark
    assert compare._data({"kind": "mlp", "dim": 4, "batch": 8, "steps": 100})[0].shape == (8 * 104, 4)


def test_every_step_synchronises_when_asked():
    assert compare._Clock(W1_STEPS, sync_every_step=True).sync_at == set(range(100))


def test_the_goal_ratios_also_come_on_whole_window_means():
    def run(block, window, cpu=None):
        return dict(_run(block, [1.0]), window_ms=window, cpu_ms=cpu)

    runs = {"W1": {"tfdist_parallelize": [run(21, 30, 52), run(20, 22, 51), run(22, 25)],
                   "hand_written": [run(20, 20, 50), run(20, 20, 50), run(20, 20, 50)]}}
    row = next(r for r in compare.ratios(runs) if r["ratio"].startswith("tfdist parallelize_module fit 2x4 / hand-written TF"))
    assert row["W1"] == pytest.approx(1.05)
    assert row["W1_window"] == pytest.approx(1.25)  # rounds 1.5, 1.1, 1.25
    table = compare.markdown(compare.summarize(runs), compare.ratios(runs), {"command": "c", "commit": "abc", "rounds": 3})
    assert row["W1_cpu"] == pytest.approx(1.03)  # rounds 1.04, 1.02; a run without it is left out
    assert "1.05 (1.00-1.10); window 1.25; cpu 1.03" in table


def test_each_round_runs_every_program_once_with_the_goal_pairs_side_by_side():
    programs = list(compare.PROGRAMS)
    orders = [compare.round_order(programs, r) for r in range(4)]
    for order in orders:
        assert sorted(order) == sorted(programs)
        for a, b in [("tfdist_parallelize", "hand_written"), ("hand_written", "tfdist_layout_map"),
                     ("tfdist_layout_map", "jax_layout_map"),
                     ("tfdist_data_parallel", "mirrored"), ("one_device", "hand_written_one_device")]:
            assert abs(order.index(a) - order.index(b)) == 1, (a, b, order)
    # forwards, then backwards: neither program of a pair always runs second
    assert orders[0].index("tfdist_parallelize") < orders[0].index("hand_written")
    assert orders[1].index("tfdist_parallelize") > orders[1].index("hand_written")
    assert [o[0] for o in orders] == ["tfdist_parallelize", "hand_written_dp", "one_device", "tf_keras_layout_map"]  # groups rotate
    assert compare.round_order(["hand_written", "extra", "one_device"], 0) == ["hand_written", "one_device", "extra"]
