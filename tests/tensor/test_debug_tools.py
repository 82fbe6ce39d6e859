"""visualize_sharding and the TFDIST_LOGS switch."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from conftest import make_mesh
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import visualize_sharding


def test_visualize_sharding_table(capsys):
    mesh = make_mesh((2, 4))
    d = distribute_tensor(np.zeros((6, 9), np.float32), mesh, [Shard(0), Shard(1)])
    text = visualize_sharding(d, header="weights")
    assert capsys.readouterr().out.strip() == text
    lines = text.splitlines()
    assert lines[0] == "weights"
    assert lines[1] == "shape [6, 9]  placements (S(0), S(1)) on ('dp', 'tp')"
    assert lines[2].split() == ["device", "coord", "dim", "0", "dim", "1"]
    rows = [line.split(None, 3) for line in lines[3:]]
    assert len(rows) == 8
    # device 7 = (1, 3): rows 3:6; 9 cols over 4 -> chunks of 3, the last one empty
    assert rows[7][0] == "cpu:7" and rows[7][3].split() == ["3:6", "empty"]
    assert rows[2][3].split() == ["0:3", "6:9"]


def test_visualize_sharding_marks_partial():
    mesh = make_mesh((2, 4))
    parts = [np.ones((2, 2), np.float32)] * 8
    p = DTensor.from_local(parts, mesh, [Replicate(), Partial("max")])
    text = visualize_sharding(p)
    assert "partial" in text.splitlines()[1] and text.count("tp=P(max)") == 8


def test_tfdist_logs_env_turns_on_redistribute_plans():
    code = (
        "import tfdist; tfdist.virtual_cpus(8)\n"
        "import numpy as np\n"
        "from tfdist.tensor import distribute_tensor, Shard, Replicate\n"
        "m = tfdist.init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp'))\n"
        "distribute_tensor(np.ones((8, 8)), m, [Shard(0), Shard(1)]).redistribute(m, [Replicate(), Shard(0)])\n"
    )
    env = {**os.environ, "TFDIST_LOGS": "redistribute", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "dp: S(0) -> R (all_gather); tp: S(1) -> S(0) (all_to_all)" in out.stderr
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**env, "TFDIST_LOGS": ""}, timeout=300)
    assert "all_gather" not in quiet.stderr
