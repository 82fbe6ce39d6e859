"""tfdist.checkpoint: save/load/async_save, resharding, planners, storage options, errors.

Reference: the numpy arrays the values were made from.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.checkpoint as dcp
from tfdist.device_mesh import DeviceMesh
from tfdist.tensor import Partial, Replicate, Shard, distribute_tensor

RNG = np.random.default_rng(3)
X = RNG.standard_normal((10, 12)).astype(np.float32)  # 10 rows: uneven over 4 and 8
PLACEMENTS_2D = [
    [Shard(0), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Shard(0)], [Shard(0), Shard(0)],
    [Shard(1), Shard(1)], [Partial(), Shard(1)], [Replicate(), Replicate()],
]


def mesh2d():
    return tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))


def mesh1d():
    return tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))


def mesh4():
    return DeviceMesh("cpu", [[4, 5], [6, 7]], mesh_dim_names=("a", "b"))


def _dt(x, mesh, placements):
    """A DTensor whose value is x; a Partial one holds x / k on each of its k replicas."""
    from tfdist.tensor import DTensor

    partial = [i for i, p in enumerate(placements) if p.is_partial()]
    if not partial:
        return distribute_tensor(x, mesh, placements)
    k = mesh.shape[partial[0]]
    block = distribute_tensor(x / k, mesh, [Replicate() if p.is_partial() else p for p in placements])
    return DTensor.from_local(block.local_tensors(), mesh, placements, shape=x.shape)


@pytest.mark.parametrize("src", PLACEMENTS_2D, ids=str)
@pytest.mark.parametrize("dst", ["1d-shard0", "1d-shard1", "2d-tp", "sub4", "plain", "numpy"])
def test_save_on_one_mesh_load_on_another(tmp_path, src, dst):
    dcp.save({"w": _dt(X, mesh2d(), src)}, checkpoint_id=tmp_path)
    targets = {
        "1d-shard0": lambda: distribute_tensor(np.zeros_like(X), mesh1d(), [Shard(0)]),
        "1d-shard1": lambda: distribute_tensor(np.zeros_like(X), mesh1d(), [Shard(1)]),
        "2d-tp": lambda: distribute_tensor(np.zeros_like(X), mesh2d(), [Shard(1), Shard(0)]),
        "sub4": lambda: distribute_tensor(np.zeros_like(X), mesh4(), [Shard(0), Shard(1)]),
        "plain": lambda: tf.zeros_like(X),
        "numpy": lambda: np.zeros_like(X),
    }
    sd = {"w": targets[dst]()}
    before = sd["w"]
    dcp.load(sd, checkpoint_id=tmp_path)
    np.testing.assert_allclose(np.asarray(sd["w"].numpy() if hasattr(sd["w"], "numpy") else sd["w"]), X, rtol=1e-6)
    if dst.startswith(("1d", "2d", "sub")):
        assert sd["w"].placements == before.placements and sd["w"].device_mesh == before.device_mesh
    if dst == "numpy":
        assert sd["w"] is before  # loaded in place


def test_every_state_dict_kind_round_trips(tmp_path):
    mesh = mesh2d()
    var = tf.Variable(X[:2])
    sd = {
        "dt": distribute_tensor(X, mesh, [Shard(0), Shard(1)]),
        "tfd": distribute_tensor(X, mesh, [Shard(1), Replicate()]).to_tf(),
        "var": var, "tensor": tf.constant(X[3]), "array": X[4].copy(), "int64": tf.range(5, dtype=tf.int64),
        "bf16": tf.cast(X[:2], tf.bfloat16), "bool": tf.constant([True, False]),
        "scalar": tf.constant(3.5), "step": 12, "name": "run-1", "nested": {"a": [1, {"b": tf.ones(2)}]},
    }
    dcp.save(sd, checkpoint_id=tmp_path)
    var.assign(tf.zeros_like(var))
    out = {
        "dt": distribute_tensor(np.zeros_like(X), mesh, [Replicate(), Replicate()]),
        "tfd": distribute_tensor(np.zeros_like(X), mesh1d(), [Shard(0)]).to_tf(),
        "var": var, "tensor": tf.zeros(12), "array": np.zeros(12, np.float32), "int64": tf.zeros(5, tf.int64),
        "bf16": tf.zeros((2, 12), tf.bfloat16), "bool": tf.constant([False, False]), "scalar": tf.constant(0.0),
        "step": 0, "name": "", "nested": {"a": [0, {"b": tf.zeros(2)}]},
    }
    dcp.load(out, checkpoint_id=tmp_path)
    np.testing.assert_array_equal(out["dt"].numpy(), X)
    from tensorflow.experimental import dtensor
    assert dtensor.is_dtensor(out["tfd"])
    np.testing.assert_array_equal(tfdist.tensor.DTensor.from_tf(out["tfd"]).numpy(), X)
    np.testing.assert_array_equal(var.numpy(), X[:2])
    assert out["var"] is var
    np.testing.assert_array_equal(out["tensor"].numpy(), X[3])
    np.testing.assert_array_equal(out["array"], X[4])
    np.testing.assert_array_equal(out["int64"].numpy(), np.arange(5))
    np.testing.assert_array_equal(out["bf16"].numpy(), tf.cast(X[:2], tf.bfloat16).numpy())
    np.testing.assert_array_equal(out["bool"].numpy(), [True, False])
    assert float(out["scalar"]) == 3.5 and out["step"] == 12 and out["name"] == "run-1"
    assert out["nested"]["a"][0] == 1
    np.testing.assert_array_equal(out["nested"]["a"][1]["b"].numpy(), np.ones(2))


def test_replicated_values_are_written_once(tmp_path):
    mesh = mesh2d()
    md = dcp.save({"r": distribute_tensor(X, mesh, [Replicate(), Replicate()]),
                   "s": distribute_tensor(X[:8], mesh, [Shard(0), Replicate()])}, checkpoint_id=tmp_path)
    assert md.state_dict_metadata["r"].chunks == [dcp.ChunkStorageMetadata(offsets=(0, 0), sizes=(10, 12))]
    assert [c.offsets for c in md.state_dict_metadata["s"].chunks] == [(0, 0), (4, 0)]
    layout = md.planner_data["layouts"]["s"]  # how it was laid out, recorded for the reader of the metadata
    assert layout["mesh_shape"] == [2, 4] and layout["mesh_dim_names"] == ["dp", "tp"]
    assert layout["placements"] == [str(Shard(0)), str(Replicate())]
    folder = tmp_path / md.storage_data["folder"]
    data = sum(f.stat().st_size for f in folder.glob("data.data-*"))
    assert data == (10 * 12 + 8 * 12) * 4  # each byte once: no replica stored twice


def test_stateful_objects_are_saved_and_loaded(tmp_path):
    class Progress:
        def __init__(self, step):
            self.step, self.seen = step, None

        def state_dict(self):
            return {"step": self.step, "w": tf.fill([3], float(self.step))}

        def load_state_dict(self, sd):
            self.step, self.seen = sd["step"], sd["w"].numpy()

    dcp.save({"progress": Progress(7)}, checkpoint_id=tmp_path)
    p = Progress(0)
    dcp.load({"progress": p}, checkpoint_id=tmp_path)
    assert p.step == 7 and list(p.seen) == [7, 7, 7]


def test_filesystem_writer_options(tmp_path):
    mesh = mesh2d()
    sd = {f"w{i}": distribute_tensor(X * i, mesh, [Shard(0), Shard(1)]) for i in range(5)}
    for kwargs in [dict(thread_count=3), dict(single_file_per_rank=False), dict(sync_files=False)]:
        path = tmp_path / "_".join(kwargs)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, **kwargs))
        out = {k: distribute_tensor(np.zeros_like(X), mesh1d(), [Shard(1)]) for k in sd}
        dcp.load(out, storage_reader=dcp.FileSystemReader(path))
        for i in range(5):
            np.testing.assert_allclose(out[f"w{i}"].numpy(), X * i, rtol=1e-6)
    dcp.save(sd, checkpoint_id=tmp_path / "once")
    with pytest.raises(FileExistsError, match="overwrite=False"):
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "once", overwrite=False))
    with pytest.raises(ValueError, match="thread_count"):
        dcp.FileSystemWriter(tmp_path, thread_count=0)


def test_per_device_read_path_equals_dtensor_restore(tmp_path):
    # the path GPU/TPU meshes take (RestoreV2 per device slice + pack), exercised on CPU
    dcp.save({"w": distribute_tensor(X, mesh2d(), [Shard(0), Shard(1)])}, checkpoint_id=tmp_path)
    reader = dcp.FileSystemReader(tmp_path)
    reader.per_device_reads = True
    sd = {"w": distribute_tensor(np.zeros_like(X), mesh1d(), [Shard(1)])}
    dcp.load(sd, storage_reader=reader)
    np.testing.assert_array_equal(sd["w"].numpy(), X)


def test_custom_planners(tmp_path):
    class BF16Planner(dcp.DefaultSavePlanner):  # torch's FP16Planner example, in bfloat16
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = [dataclasses.replace(i, tensor_data=dataclasses.replace(
                i.tensor_data, properties=dcp.TensorProperties("bfloat16"))) if i.tensor_data else i
                for i in plan.items]
            return dataclasses.replace(plan, items=items)

    class RenamePlanner(dcp.DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            super().set_up_planner({"foo_" + k: v for k, v in state_dict.items()}, metadata, is_coordinator)

    md = dcp.save({"w": distribute_tensor(X, mesh2d(), [Shard(0), Shard(1)])}, checkpoint_id=tmp_path,
                  planner=BF16Planner())
    assert md.state_dict_metadata["w"].properties.dtype == "bfloat16"
    sd = {"w": tf.zeros(X.shape, tf.bfloat16)}
    dcp.load(sd, checkpoint_id=tmp_path)
    np.testing.assert_array_equal(sd["w"].numpy(), tf.cast(X, tf.bfloat16).numpy())
    dcp.save({"foo_v": tf.constant(X)}, checkpoint_id=tmp_path / "r")
    planner = RenamePlanner()
    target = {"v": tf.zeros_like(X)}
    dcp.load(target, checkpoint_id=tmp_path / "r", planner=planner)
    np.testing.assert_array_equal(planner.state_dict["foo_v"].numpy(), X)


def test_partial_load_and_missing_keys(tmp_path):
    dcp.save({"a": tf.constant(X)}, checkpoint_id=tmp_path)
    with pytest.raises(KeyError, match="'b' is missing"):
        dcp.load({"a": tf.zeros_like(X), "b": tf.zeros(3)}, checkpoint_id=tmp_path)
    sd = {"a": tf.zeros_like(X), "b": tf.zeros(3)}
    dcp.load(sd, checkpoint_id=tmp_path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    np.testing.assert_array_equal(sd["a"].numpy(), X)
    np.testing.assert_array_equal(sd["b"].numpy(), np.zeros(3))


def test_mismatches_and_bad_arguments_name_the_key(tmp_path):
    dcp.save({"a": tf.constant(X)}, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match=r"'a' has shape \(10, 12\).*\(12, 10\)"):
        dcp.load({"a": tf.zeros((12, 10))}, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match="'a' has dtype float32.*float64"):
        dcp.load({"a": tf.zeros((10, 12), tf.float64)}, checkpoint_id=tmp_path)
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        dcp.save([tf.ones(2)], checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match="checkpoint_id"):
        dcp.save({"a": 1})
    with pytest.raises(ValueError, match="process_group must be None"):
        dcp.save({"a": 1}, checkpoint_id=tmp_path, process_group="group")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        dcp.load({"a": tf.zeros(1)}, checkpoint_id=tmp_path / "none")
    with pytest.raises(ValueError, match="AsyncCheckpointerType.THREAD or .PROCESS"):
        dcp.async_save({"a": 1}, checkpoint_id=tmp_path, async_checkpointer_type="thread")


def test_corrupted_truncated_and_wrong_version_fail_clearly(tmp_path):
    dcp.save({"a": tf.constant(X), "b": tf.constant(X[0])}, checkpoint_id=tmp_path)
    meta = (tmp_path / ".metadata").read_text()
    folder = next(tmp_path.glob("save-*"))
    data = next(folder.glob("data.data-*"))
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF  # one flipped byte inside 'a' (written first)
    data.write_bytes(bytes(raw))
    with pytest.raises(dcp.CheckpointCorruptError, match="'a'"):
        dcp.load({"a": tf.zeros_like(X)}, checkpoint_id=tmp_path)
    data.write_bytes(bytes(raw[:-7]))
    with pytest.raises(dcp.CheckpointCorruptError, match="truncated"):
        dcp.load({"a": tf.zeros_like(X)}, checkpoint_id=tmp_path)
    (tmp_path / ".metadata").write_text(meta.replace('"version": 1', '"version": 99'))
    with pytest.raises(ValueError, match="format version 99"):
        dcp.load({"a": tf.zeros_like(X)}, checkpoint_id=tmp_path)
    (tmp_path / ".metadata").write_text("{not json")
    with pytest.raises(ValueError, match="not a tfdist checkpoint"):
        dcp.load({"a": tf.zeros_like(X)}, checkpoint_id=tmp_path)


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    dcp.save({"a": tf.constant(X)}, checkpoint_id=tmp_path)

    class Exploding(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn == "b":
                raise RuntimeError("disk full")
            return super().resolve_data(write_item)

    with pytest.raises(RuntimeError, match="disk full"):
        dcp.save({"a": tf.constant(-X), "b": tf.ones(3)}, checkpoint_id=tmp_path, planner=Exploding())
    assert len(list(tmp_path.glob("save-*"))) == 1  # the failed save's directory is gone
    sd = {"a": tf.zeros_like(X)}
    dcp.load(sd, checkpoint_id=tmp_path)
    np.testing.assert_array_equal(sd["a"].numpy(), X)
    dcp.save({"a": tf.constant(2 * X)}, checkpoint_id=tmp_path)  # a later save replaces it
    dcp.load(sd, checkpoint_id=tmp_path)
    np.testing.assert_array_equal(sd["a"].numpy(), 2 * X)
    assert len(list(tmp_path.glob("save-*"))) == 1


def test_async_save_snapshots_state_and_reports_errors(tmp_path):
    mesh = mesh2d()
    from tensorflow.experimental import dtensor

    var = dtensor.DVariable(distribute_tensor(X, mesh, [Shard(0), Shard(1)]).to_tf())
    plain = tf.Variable(X[0])
    import threading

    mutated = threading.Event()

    class WaitsForTraining(dcp.DefaultSavePlanner):  # writes only after the training step below ran
        def resolve_data(self, write_item):
            assert mutated.wait(30)
            return super().resolve_data(write_item)

    future = dcp.async_save({"v": var, "p": plain, "step": 3}, checkpoint_id=tmp_path, planner=WaitsForTraining())
    var.assign_add(tf.ones_like(var))  # training goes on while the save is written
    plain.assign(tf.zeros(12))
    mutated.set()
    md = future.result(timeout=60)
    assert isinstance(md, dcp.Metadata)
    sd = {"v": distribute_tensor(np.zeros_like(X), mesh1d(), [Shard(0)]), "p": tf.zeros(12), "step": 0}
    dcp.load(sd, checkpoint_id=tmp_path)
    np.testing.assert_array_equal(sd["v"].numpy(), X)  # the values at async_save time
    np.testing.assert_array_equal(sd["p"].numpy(), X[0])
    assert sd["step"] == 3
    # an error while writing surfaces on the future; the checkpoint stays the previous one
    class Failing(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):
            raise OSError("no space left on device")

    bad = dcp.async_save({"v": var}, checkpoint_id=tmp_path, planner=Failing())
    with pytest.raises(OSError, match="no space"):
        bad.result(timeout=60)
    dcp.load(sd, checkpoint_id=tmp_path)
    np.testing.assert_array_equal(sd["v"].numpy(), X)


def test_custom_storage_written_with_the_public_protocol():
    """An in-memory StorageWriter/Reader written as a user would: resolve_data gives each chunk,
    commit_tensor takes a whole value."""
    from concurrent.futures import Future

    store: dict = {"chunks": []}

    def done(value):
        f = Future()
        f.set_result(value)
        return f

    class MemoryWriter(dcp.StorageWriter):
        def reset(self, checkpoint_id=None): pass
        def set_up_storage_writer(self, is_coordinator): pass
        def prepare_local_plan(self, plan): return plan
        def prepare_global_plan(self, plans): return plans

        def write_data(self, plan, planner):
            for item in plan.items:
                data = planner.resolve_data(item)
                offsets = item.tensor_data.chunk.offsets if item.tensor_data else None
                store["chunks"].append((item.index.fqn, offsets, np.asarray(data) if offsets is not None else data))
            return done([dcp.WriteResult(i.index, 0, None) for i in plan.items])

        def finish(self, metadata, results): store["metadata"] = metadata

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id): return True

    class MemoryReader(dcp.StorageReader):
        def reset(self, checkpoint_id=None): pass
        def read_metadata(self): return store["metadata"]
        def set_up_storage_reader(self, metadata, is_coordinator): pass
        def prepare_local_plan(self, plan): return plan
        def prepare_global_plan(self, plans): return plans

        def read_data(self, plan, planner):
            for item in plan.items:
                fqn = item.dest_index.fqn
                if item.type == dcp.LoadItemType.BYTE_IO:
                    planner.load_bytes(item, next(v for f, _, v in store["chunks"] if f == fqn))
                    continue
                md = store["metadata"].state_dict_metadata[fqn]
                full = np.zeros(md.size, np.float32)
                for f, offsets, arr in store["chunks"]:
                    if f == fqn:
                        full[tuple(slice(o, o + n) for o, n in zip(offsets, arr.shape))] = arr
                planner.resolve_tensor(item)
                planner.commit_tensor(item, full)
            return done(None)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id): return True

    dcp.save({"w": distribute_tensor(X, mesh2d(), [Shard(0), Shard(1)]), "note": "hi"}, storage_writer=MemoryWriter())
    assert len([c for c in store["chunks"] if c[0] == "w"]) == 8  # one chunk per device, written once
    sd = {"w": distribute_tensor(np.zeros_like(X), mesh1d(), [Shard(1)]), "note": ""}
    dcp.load(sd, storage_reader=MemoryReader())
    np.testing.assert_array_equal(sd["w"].numpy(), X)
    assert sd["w"].placements == (Shard(1),) and sd["note"] == "hi"
