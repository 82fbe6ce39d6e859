"""The console command, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _tfdist(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tfdist.cli", *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def test_demo_shows_sharding_and_collectives():
    out = _tfdist("demo")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "DeviceMesh('cpu', [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=('dp', 'tp'))" in text
    assert "cpu:5   (1, 1)  3:6    2:4" in text  # device 5 holds rows 3:6, cols 2:4
    assert "dp: S(0) -> R (all_gather)" in text and "tp: S(1) -> S(0) (all_to_all)" in text
    assert "tp: P(sum) -> S(0) (reduce_scatter)" in text
    assert "value: 6 = 0+1+2+3" in text
    assert "result (Shard(dim=0), Replicate()), value 8 (= 8)" in text
    # the Keras part: GPT trained with model.fit on the 2x4 mesh, weights sharded on tp
    losses = [float(v) for v in text.split("model.fit loss per epoch: ")[1].splitlines()[0].split(", ")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5
    assert "gpt/block/mlp/dense/kernel           (32, 128)    ['unsharded', 'tp']" in text
    assert "collectives in one train step" in text


def test_info_lists_devices_and_versions():
    out = _tfdist("info", "--virtual-cpus", "4")
    assert out.returncode == 0, out.stderr
    assert "device type    cpu" in out.stdout
    assert "local devices  4" in out.stdout
    assert "tensorflow     2.21" in out.stdout and "keras          3." in out.stdout
