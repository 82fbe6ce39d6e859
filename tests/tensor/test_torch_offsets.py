"""Each device's local shape and global offset equal torch's, for even, uneven and empty shards and one
tensor dim over several mesh dims (fixtures/torch_offsets.json, written by torch 2.13 with
fixtures/generate_torch_offsets.py): the helper ``compute_local_shape_and_global_offset``, and the chunks
a DTensor reports to the checkpoint (``__create_chunk_list__``) and its ``local_tensors``."""

from __future__ import annotations

import itertools
import json
import pathlib
import re

import numpy as np
import pytest

from conftest import make_mesh
from tfdist.tensor import DTensor, Replicate, Shard, compute_local_shape_and_global_offset, distribute_tensor

CASES = json.loads((pathlib.Path(__file__).parent / "fixtures" / "torch_offsets.json").read_text())["cases"]


def placements(case):
    return [Shard(int(re.search(r"\d+", p).group())) if p.startswith("Shard") else Replicate()
            for p in case["placements"]]


def case_id(case):
    return f"{'x'.join(map(str, case['mesh']))}-{'x'.join(map(str, case['shape']))}-" + \
        ",".join(p.replace("Shard(dim=", "S").replace(")", "").replace("Replicate(", "R") for p in case["placements"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_local_shape_and_offset_equal_torchs(case):
    mesh = make_mesh(tuple(case["mesh"])) if len(case["mesh"]) > 1 or case["mesh"] == [8] else \
        make_mesh((4, 2))["dp"]
    for coord, (shape, offset) in case["shards"].items():
        coord = [int(c) for c in coord.split(",")]
        got = compute_local_shape_and_global_offset(case["shape"], mesh, placements(case), coord)
        assert got == (tuple(shape), tuple(offset)), (coord, got)


@pytest.mark.parametrize("case", [c for c in CASES if len(c["mesh"]) > 1 and len(c["shape"]) == 2], ids=case_id)
def test_a_dtensors_chunks_and_local_tensors_equal_torchs(case):
    """On the full 8-device meshes: the checkpoint's chunks in mesh order, and each local tensor is the
    global array's block at torch's offset with torch's shape."""
    mesh = make_mesh(tuple(case["mesh"]))
    full = np.arange(np.prod(case["shape"]), dtype=np.float32).reshape(case["shape"])
    dt = distribute_tensor(full, mesh, placements(case))
    coords = list(itertools.product(*(range(n) for n in case["mesh"])))
    want = [case["shards"][",".join(map(str, c))] for c in coords]
    chunks = dt.__create_chunk_list__()
    assert [(list(c.sizes), list(c.offsets)) for c in chunks] == [tuple(w) for w in want]
    for local, (shape, offset) in zip(dt.local_tensors(), want):
        block = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        np.testing.assert_array_equal(local.numpy(), block)
    assert isinstance(dt, DTensor)
