"""2-D moves out of Partial send no more than torch's plan (torch 2.13's own planner, committed as
fixtures/torch_partial_2d_plans.json by fixtures/generate_torch_partial_2d_plans.py); values equal numpy."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode

PLANS = json.loads((pathlib.Path(__file__).parent / "fixtures" / "torch_partial_2d_plans.json").read_text())
FULL = np.arange(64.0).reshape(8, 8)


def placement(text):
    if text.startswith("P"):
        return Partial("avg") if "avg" in text else Partial()
    return Replicate() if text == "R" else Shard(int(text[1]))


def partial_input(mesh, src):
    """A DTensor with placements ``src`` whose value is FULL: Partial(sum) mesh dims split it 1:3."""
    whole = [Replicate() if p.is_partial() else p for p in src]
    blocks = distribute_tensor(FULL, mesh, whole).local_tensors()
    coords = [(i, j) for i in range(2) for j in range(2)]
    weights = []
    for i, j in coords:
        w = 1.0
        for m, p in enumerate(src):
            if p.is_partial() and p.reduce_op == "sum":
                w *= (0.25, 0.75)[(i, j)[m]]
        weights.append(w)
    return DTensor.from_local([b * w for b, w in zip(blocks, weights)], mesh, src)


@pytest.mark.parametrize("move", PLANS["moves"], ids=lambda m: f"{m['src']}->{m['dst']}")
def test_move_out_of_partial_sends_at_most_torchs_bytes(move):
    mesh = tfdist.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))
    src = [placement(t) for t in move["src"].split(",")]
    dst = [placement(t) for t in move["dst"].split(",")]
    x = partial_input(mesh, src)
    np.testing.assert_allclose(x.full_tensor().numpy(), FULL)
    step = tf.function(lambda x: x.redistribute(mesh, dst))
    step(x)
    with CommDebugMode() as comm:
        y = step(x)
    assert tuple(y.placements) == tuple(dst)
    np.testing.assert_allclose(y.full_tensor().numpy(), FULL)
    sent = sum(comm.get_comm_bytes().values())
    assert sent <= move["bytes_per_device"], (comm.get_comm_counts(), sent, move)
