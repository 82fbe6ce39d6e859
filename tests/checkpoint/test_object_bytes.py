"""Non-tensor values in a checkpoint follow torch's BYTE_IO protocol: the save planner's resolve_data gives
an io.BytesIO, the storage reader gives load_bytes an io.BytesIO, and resolve_bytes exists as torch's."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import zlib

import numpy as np
import pytest
import tensorflow as tf

import tfdist.checkpoint as dcp


@dataclasses.dataclass
class Schedule:
    """A user's object: pickled, so any picklable Python value round-trips."""

    name: str
    milestones: tuple[int, ...]
    gamma: float


STATE = {
    "w": tf.constant(np.arange(6.0, dtype=np.float32).reshape(2, 3)),
    "step": 7,
    "schedule": Schedule("cosine", (10, 20), 0.5),
    "extra": {"seen": {"a", "b"}, "table": Schedule("step", (1,), 0.1), "note": b"raw bytes"},
    "buffer": io.BytesIO(b"opaque blob"),
}


def _fresh() -> dict:
    return {"w": tf.zeros((2, 3)), "step": 0, "schedule": None, "extra": {"seen": set(), "table": None, "note": b""},
            "buffer": io.BytesIO()}


def _check(sd: dict) -> None:
    np.testing.assert_array_equal(sd["w"].numpy(), STATE["w"].numpy())
    assert sd["step"] == 7 and sd["schedule"] == STATE["schedule"]
    assert sd["extra"]["seen"] == {"a", "b"} and sd["extra"]["note"] == b"raw bytes"
    assert sd["extra"]["table"] == Schedule("step", (1,), 0.1)
    assert sd["buffer"].getvalue() == b"opaque blob"


def test_arbitrary_python_objects_round_trip(tmp_path):
    dcp.save(STATE, checkpoint_id=tmp_path)
    sd = _fresh()
    dcp.load(sd, checkpoint_id=tmp_path)
    _check(sd)


def test_planners_see_torchs_bytes_protocol(tmp_path):
    given = []

    class Recording(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            given.append((read_item.dest_index.fqn, type(value)))
            super().load_bytes(read_item, value)

    class Saving(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if write_item.type == dcp.WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO) and pickle.loads(data.getvalue()) is not None
            return data

    dcp.save(STATE, checkpoint_id=tmp_path, planner=Saving())
    sd = _fresh()
    dcp.load(sd, checkpoint_id=tmp_path, planner=Recording())
    _check(sd)
    assert sorted(given) == sorted((k, io.BytesIO) for k in ("step", "schedule", "extra.seen", "extra.table",
                                                              "extra.note", "buffer")), given


def test_resolve_bytes_is_torchs():
    """torch's LoadPlanner.resolve_bytes raises NotImplementedError; tfdist's default planner hands out the
    state dict's own io.BytesIO (to be filled in place) and refuses other values naming them."""
    item = dcp.ReadItem(dcp.LoadItemType.BYTE_IO, dcp.MetadataIndex("buffer"), (), dcp.MetadataIndex("buffer"),
                        (), ())
    with pytest.raises(NotImplementedError, match="LoadPlanner.resolve_bytes is not implemented"):
        dcp.LoadPlanner.resolve_bytes(None, item)
    planner = dcp.DefaultLoadPlanner()
    buffer = io.BytesIO()
    planner.set_up_planner({"buffer": buffer, "step": 0}, None, True)
    assert planner.resolve_bytes(item) is buffer
    other = dataclasses.replace(item, dest_index=dcp.MetadataIndex("step"))
    with pytest.raises(NotImplementedError, match=r"resolve_bytes: the state dict's 'step' is a int"):
        planner.resolve_bytes(other)


def test_checkpoints_written_before_objects_were_bytes_still_load(tmp_path):
    """Earlier tfdist stored each rank's objects pickled as one dict; such a checkpoint still loads."""
    dcp.save({"w": STATE["w"], "step": 7, "schedule": STATE["schedule"]}, checkpoint_id=tmp_path)
    (save,) = tmp_path.glob("save-*")
    (objects,) = save.glob("*.objects")
    objects.write_bytes(pickle.dumps({"step": 7, "schedule": STATE["schedule"]}))  # the old layout
    meta = json.loads((tmp_path / ".metadata").read_text())
    meta["storage_data"]["files"][objects.name] = {"size": objects.stat().st_size,
                                                   "crc32": zlib.crc32(objects.read_bytes())}
    (tmp_path / ".metadata").write_text(json.dumps(meta))
    sd = {"w": tf.zeros((2, 3)), "step": 0, "schedule": None}
    dcp.load(sd, checkpoint_id=tmp_path)
    assert sd["step"] == 7 and sd["schedule"] == STATE["schedule"]
