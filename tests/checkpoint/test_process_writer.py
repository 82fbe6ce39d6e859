"""async_save(async_checkpointer_type=PROCESS): a persistent writer process writes the tensor bundles."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.checkpoint as dcp
from tfdist.checkpoint import _writer_process
from tfdist.tensor import Shard, distribute_tensor


def test_process_saves_load_as_thread_saves_and_reuse_one_writer_process(tmp_path):
    mesh = tfdist.init_device_mesh("cpu", (2, 4))
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    state = {"w": distribute_tensor(w, mesh, [Shard(0), Shard(1)]), "b": tf.constant([1.5, 2.5], tf.bfloat16),
             "step": 3}
    kind = dcp.AsyncCheckpointerType.PROCESS
    dcp.async_save(state, checkpoint_id=tmp_path / "a", async_checkpointer_type=kind).result()
    pid = _writer_process.writer_pid()
    assert pid is not None and pid != os.getpid()
    state["step"] = 4
    dcp.async_save(state, checkpoint_id=tmp_path / "b", async_checkpointer_type=kind).result()
    assert _writer_process.writer_pid() == pid  # the same persistent process
    for name, step in (("a", 3), ("b", 4)):
        sd = {"w": distribute_tensor(np.zeros_like(w), tfdist.init_device_mesh("cpu", (8,)), [Shard(1)]),
              "b": tf.zeros(2, tf.bfloat16), "step": 0}
        dcp.load(sd, checkpoint_id=tmp_path / name)
        np.testing.assert_array_equal(sd["w"].numpy(), w)
        np.testing.assert_array_equal(tf.cast(sd["b"], tf.float32).numpy(), [1.5, 2.5])
        assert sd["step"] == step


def test_process_saves_refuse_other_writers_and_report_the_childs_error(tmp_path):
    class Other(dcp.StorageWriter):  # a storage writer of the user's own
        def reset(self, checkpoint_id=None): pass
        def set_up_storage_writer(self, is_coordinator): pass
        def prepare_local_plan(self, plan): return plan
        def prepare_global_plan(self, plans): return plans
        def write_data(self, plan, planner): raise AssertionError("not reached")
        def finish(self, metadata, results): pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id): return True

    with pytest.raises(ValueError, match=r"async_checkpointer_type=PROCESS\) writes with tfdist's FileSystemWriter"):
        dcp.async_save({"x": tf.ones(2)}, storage_writer=Other(),
                       async_checkpointer_type=dcp.AsyncCheckpointerType.PROCESS)
    with pytest.raises(RuntimeError, match="the checkpoint writer process failed to write"):
        _writer_process.write_bundle(str(tmp_path / "bundle"), ["x"], ["not a slice spec"], [tf.ones(2)])
