"""torch.save files <-> checkpoints, with torch as the reference (skipped where torch is not installed:
torch is an optional extra, never a dependency of tfdist or of its default tests)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.checkpoint as dcp
from tfdist.checkpoint.format_utils import (
    BroadcastingTorchSaveReader, DynamicMetaLoadPlanner, dcp_to_torch_save, torch_save_to_dcp,
)
from tfdist.tensor import Replicate, Shard, distribute_tensor

torch = pytest.importorskip("torch", reason="torch is optional (pip install 'tfdist[torch]'); these "
                                            "converters read and write torch.save files")

W = np.arange(48, dtype=np.float32).reshape(8, 6)


def _torch_state():
    return {"model": {"w": torch.from_numpy(W.copy()), "b": torch.arange(6, dtype=torch.int64),
                      "h": torch.tensor([1.5, -2.25], dtype=torch.bfloat16)},
            "opt": [torch.ones(3, dtype=torch.float64), {"lr": 0.1}], "step": 12}


def test_a_torch_save_file_becomes_a_checkpoint_loadable_on_any_mesh(tmp_path):
    torch.save(_torch_state(), tmp_path / "model.pt")
    torch_save_to_dcp(tmp_path / "model.pt", tmp_path / "ckpt")
    mesh = tfdist.init_device_mesh("cpu", (2, 4))
    sd = {"model": {"w": distribute_tensor(np.zeros_like(W), mesh, [Shard(0), Shard(1)]), "b": tf.zeros(6, tf.int64),
                    "h": tf.zeros(2, tf.bfloat16)},
          "opt": [tf.zeros(3, tf.float64), {"lr": 0.0}], "step": 0}
    dcp.load(sd, checkpoint_id=tmp_path / "ckpt")
    np.testing.assert_array_equal(sd["model"]["w"].numpy(), W)
    assert sd["model"]["w"].placements == (Shard(0), Shard(1))
    np.testing.assert_array_equal(sd["model"]["b"].numpy(), np.arange(6))
    np.testing.assert_array_equal(tf.cast(sd["model"]["h"], tf.float32).numpy(), [1.5, -2.25])
    np.testing.assert_array_equal(sd["opt"][0].numpy(), np.ones(3))
    assert sd["opt"][1] == {"lr": 0.1} and sd["step"] == 12


def test_a_checkpoint_becomes_the_torch_save_file_torch_loads(tmp_path):
    mesh = tfdist.init_device_mesh("cpu", (8,))
    state = {"model": {"w": distribute_tensor(W, mesh, [Shard(0)]), "h": tf.constant([1.5, -2.25], tf.bfloat16)},
             "opt": [tf.ones(3, tf.float64), {"lr": 0.1}], "step": 12}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert set(loaded) == {"model", "opt", "step"} and loaded["step"] == 12
    assert torch.equal(loaded["model"]["w"], torch.from_numpy(W))
    assert loaded["model"]["h"].dtype == torch.bfloat16 and loaded["model"]["h"].tolist() == [1.5, -2.25]
    assert torch.equal(loaded["opt"][0], torch.ones(3, dtype=torch.float64)) and loaded["opt"][1] == {"lr": 0.1}


def test_load_a_torch_save_file_directly_with_the_broadcasting_reader(tmp_path):
    torch.save(_torch_state(), tmp_path / "model.pt")
    mesh = tfdist.init_device_mesh("cpu", (2, 4))
    sd = {"model": {"w": distribute_tensor(np.zeros_like(W), mesh, [Replicate(), Shard(0)]),
                    "b": tf.zeros(6, tf.int64), "h": tf.zeros(2, tf.bfloat16)},
          "opt": [tf.zeros(3, tf.float64), {"lr": 0.0}], "step": 0}
    dcp.load(sd, storage_reader=BroadcastingTorchSaveReader(tmp_path / "model.pt"), planner=DynamicMetaLoadPlanner())
    np.testing.assert_array_equal(sd["model"]["w"].numpy(), W)
    assert sd["model"]["w"].placements == (Replicate(), Shard(0))
    np.testing.assert_array_equal(tf.cast(sd["model"]["h"], tf.float32).numpy(), [1.5, -2.25])
    assert sd["opt"][1] == {"lr": 0.1} and sd["step"] == 12
    with pytest.raises(KeyError, match="has no entry 'extra'"):
        dcp.load({"extra": tf.zeros(2)}, storage_reader=BroadcastingTorchSaveReader(tmp_path / "model.pt"),
                 planner=DynamicMetaLoadPlanner())
