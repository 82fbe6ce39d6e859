"""kill -9 during a save: the previous checkpoint always loads, a partial one is never accepted."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.checkpoint as dcp
from tfdist.tensor import Replicate, distribute_tensor

CHILD = pathlib.Path(__file__).parent / "save_forever.py"
pytestmark = pytest.mark.slow


def _run_until(path: pathlib.Path, stop) -> list[str]:
    """Starts the saving child, kills it (SIGKILL) when ``stop(line)`` says so; returns its lines."""
    child = subprocess.Popen([sys.executable, str(CHILD), str(path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    lines = []
    try:
        for line in child.stdout:
            lines.append(line.strip())
            if stop(lines[-1]):
                break
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert lines and lines[0] == "ready", lines
    return lines


def _check_loads(path: pathlib.Path, lines: list[str], previous: int) -> int:
    mesh = tfdist.init_device_mesh("cpu", (2, 4))
    sd = {"w": distribute_tensor(np.zeros((64, 32), np.float32), mesh, [Replicate(), Replicate()]),
          "version": -1, "b": tf.zeros(5)}
    dcp.load(sd, checkpoint_id=path)
    v = sd["version"]
    committed = [int(x.split()[1]) for x in lines if x.startswith("saved")]
    # what loads is one whole version: the last reported save or the one in flight (or, if this child
    # committed nothing, what the checkpoint held before it)
    last = committed[-1] if committed else 0
    allowed = {last, last + 1} | (set() if committed else {previous})
    assert v in allowed, (v, allowed, lines[-3:])
    np.testing.assert_array_equal(sd["w"].numpy(), np.full((64, 32), v, np.float32))
    np.testing.assert_array_equal(sd["b"].numpy(), np.full(5, v, np.float32))
    return v


def test_kill_at_random_points_of_saves_never_breaks_the_checkpoint(tmp_path):
    dcp.save({"w": tf.zeros((64, 32)), "version": 0, "b": tf.zeros(5)}, checkpoint_id=tmp_path)
    rng = random.Random(7)
    stops = []
    # deterministic points: while data is written, in the middle of the metadata write, right after a save
    for k in range(1, 4):
        stops += [f"phase data {k}", f"phase meta {k}", f"saved {k}"]
    stops += [None] * 14  # random instants during continuous saving
    killed_in, version = [], 0
    for stop in stops:
        if stop is None:
            deadline = []

            def at_time(line, deadline=deadline):
                if line == "ready":
                    deadline.append(time.monotonic() + rng.uniform(0.0, 1.5))
                return bool(deadline) and time.monotonic() >= deadline[0]
            lines = _run_until(tmp_path, at_time)
        else:
            lines = _run_until(tmp_path, lambda line, stop=stop: line == stop)
        killed_in.append(lines[-1])
        version = _check_loads(tmp_path, lines, version)
    assert len(stops) >= 20
    # the next successful save removes what the killed ones left behind
    dcp.save({"w": tf.ones((64, 32)), "version": 99, "b": tf.ones(5)}, checkpoint_id=tmp_path)
    assert len(list(tmp_path.glob("save-*"))) == 1 and not list(tmp_path.glob(".metadata.tmp-*"))
    assert sum(x.startswith("phase meta") for x in killed_in) >= 3
