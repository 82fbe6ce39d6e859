"""A pipeline step under the TensorFlow profiler: every action of every rank is in the trace, on its
rank's thread, in plan order; different ranks' actions overlap in the profiler's own clock; the
kernels TF ran are there beside them.

Reference: the schedule's plan (pipeline_order), and the kernel names the
stages' Dense layers must produce (MatMul kernels).
"""

from __future__ import annotations

import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.pipelining import PipelineProfile, PipelineStage, Schedule1F1B, plot_schedule, read_profile

RNG = np.random.default_rng(2)
X, Y = RNG.standard_normal((128, 64)).astype("float32"), RNG.standard_normal((128, 64)).astype("float32")


def mse(y, t):
    return tf.reduce_mean((y - t) ** 2)


def test_the_profiler_trace_shows_every_action_and_ranks_overlapping(tmp_path):
    keras.utils.set_random_seed(0)
    stages = [PipelineStage(keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="tanh"),
                                              keras.layers.Dense(64)]), i, 4, f"CPU:{2 * i}") for i in range(4)]
    schedule = Schedule1F1B(stages, 8, loss_fn=mse)
    schedule.step(X, target=Y)  # compile outside the trace
    tf.profiler.experimental.start(str(tmp_path))
    try:
        schedule.step(X, target=Y)
    finally:
        tf.profiler.experimental.stop()
    profile = read_profile(tmp_path)
    planned = {r: [str(a) for a in acts if a is not None] for r, acts in schedule._execution_order().items()}
    assert {r: [a for a, _, _ in acts] for r, acts in profile.actions.items()} == planned
    for acts in profile.actions.values():  # one thread per rank: its actions never overlap each other
        assert all(e0 <= s1 for (_, _, e0), (_, s1, _) in zip(acts, acts[1:]))
    assert profile.concurrency() > 1.0  # ...but the ranks' actions do
    names = {name for _, name, _, _ in profile.kernels}
    assert any("MatMul" in n for n in names), sorted(names)[:20]
    assert 0.0 <= profile.kernel_overlap() <= 1.0
    path = plot_schedule(schedule, tmp_path / "profiled.png", profile=profile)
    assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_arithmetic_by_hand():
    profile = PipelineProfile(actions={0: [("0F0", 0.0, 2.0)], 1: [("1F0", 1.0, 3.0)]},
                              kernels=[("t0", "a:MatMul", 0.0, 2.0), ("t1", "b:MatMul", 1.0, 4.0)])
    assert profile.concurrency() == pytest.approx(4.0 / 3.0)  # 4 busy seconds over a 3-second span
    assert profile.kernel_overlap() == pytest.approx(1.0 / 4.0)  # 1 of the 4 busy seconds runs two kernels


def test_read_profile_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no profiler trace.*tf.profiler.experimental.start"):
        read_profile(tmp_path)
