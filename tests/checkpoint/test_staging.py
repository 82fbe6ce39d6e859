"""async_save's staging (torch.distributed.checkpoint.staging): which stager runs, when
synchronize_staging is called, and that a staged copy does not follow later updates."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist.checkpoint as dcp
from tfdist.checkpoint.staging import AsyncStager, BlockingAsyncStager


def test_a_staged_copy_does_not_follow_later_updates():
    v = tf.Variable(np.arange(4.0, dtype=np.float32))
    staged = BlockingAsyncStager().stage({"v": v, "step": 3})
    v.assign_add(tf.ones(4))
    np.testing.assert_array_equal(np.asarray(staged["v"]), np.arange(4.0))
    assert staged["step"] == 3
    assert BlockingAsyncStager().should_synchronize_after_execute is False


def test_async_save_stages_with_the_writer_or_the_given_stager(tmp_path):
    calls = []

    class Writer(dcp.FileSystemWriter):
        def stage(self, state_dict):
            calls.append("writer")
            return super().stage(state_dict)

    class Overlapping(AsyncStager):
        _synchronize_after_execute = True

        def stage(self, state_dict):
            calls.append("stager")
            return BlockingAsyncStager().stage(state_dict)

        def synchronize_staging(self):
            calls.append("synchronize")

    v = tf.Variable(np.full(3, 2.0, np.float32))
    dcp.async_save({"v": v}, storage_writer=Writer(tmp_path / "a")).result()
    assert calls == ["writer"]
    dcp.async_save({"v": v}, storage_writer=Writer(tmp_path / "b"), async_stager=Overlapping()).result()
    assert calls == ["writer", "stager", "synchronize"]  # the given stager wins; it asked to be synchronized
    for name in ("a", "b"):
        sd = {"v": tf.zeros(3)}
        dcp.load(sd, checkpoint_id=tmp_path / name)
        np.testing.assert_array_equal(sd["v"].numpy(), np.full(3, 2.0))


def test_stager_errors_are_clear(tmp_path):
    with pytest.raises(NotImplementedError, match="AsyncStager.stage must return a staged copy"):
        AsyncStager().stage({})
    with pytest.raises(TypeError, match="async_stager must be a tfdist.checkpoint.staging.AsyncStager"):
        dcp.async_save({"x": 1}, checkpoint_id=tmp_path, async_stager=object())
    with pytest.raises(TypeError, match=r"stage: the state dict's 'opt.hook' \(function\) cannot be saved"):
        BlockingAsyncStager(type_check=True).stage({"opt": {"hook": lambda: 0}})
