"""Moves and reductions of every dtype: TF's all-to-all carries floats and 32/64-bit signed integers
only, and its reductions no bools; tfdist carries the others (tfdist/tensor/_redistribute/_moves.py).
References: numpy for the values, torch's own results for a Partial of bools (fixtures/)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode

MESH = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b"))
TORCH_BOOL = json.loads((pathlib.Path(__file__).parent / "fixtures" / "torch_bool_partial.json").read_text())

# bytes each device sends in an all-to-all, relative to torch's (which moves the dtype's own bytes)
CARRIED_BYTES = {"bool": 2, "int8": 2, "uint8": 2}


def _values(dtype: str) -> np.ndarray:
    base = np.arange(8 * 8 * 4).reshape(8, 8, 4) % 7 - 3
    if dtype == "bool":
        return base > 0
    if dtype.startswith("complex"):
        return (base + 2j * base).astype(dtype)
    return (np.abs(base) if dtype.startswith("u") else base).astype(dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "uint16", "uint32", "uint64", "complex64",
                                   "complex128", "bfloat16", "float32"])
def test_a_mesh_dim_moves_to_another_tensor_dim_in_every_dtype(dtype, graph):
    """Shard(0), Shard(1) -> Shard(1), Shard(2): two all-to-alls; exact values, the dtype kept, and
    torch's bytes (twice them for 1-byte types, which TF carries as float16)."""
    x = tf.constant(_values(dtype)) if dtype != "bfloat16" else tf.cast(_values("float32"), tf.bfloat16)
    d = distribute_tensor(x, MESH, [Shard(0), Shard(1)])
    move = lambda t: t.redistribute(MESH, [Shard(1), Shard(2)])  # noqa: E731
    if graph:
        fn = tf.function(lambda t: move(t).to_tf())
        fn(d)
        with CommDebugMode() as comm:
            out = DTensor.from_tf(fn(d))
    else:
        with CommDebugMode() as comm:
            out = move(d)
    assert out.dtype == x.dtype and out.placements == (Shard(1), Shard(2))
    np.testing.assert_array_equal(out.numpy(), x.numpy())
    if dtype == "complex128":  # no 16-byte carrier: gathered then sliced (documented in _moves.py)
        return
    assert comm.get_comm_counts() == {"all_to_all_single": 2}
    # a device's shard is 4 x 2 x 4 = 32 elements; an all-to-all over k devices sends (k-1)/k of it:
    # over b (k = 4) then over a (k = 2)
    size = (x.dtype.size if x.dtype != tf.bool else 1) * CARRIED_BYTES.get(dtype, 1)
    assert comm.get_comm_bytes()["all_to_all_single"] == pytest.approx((3 / 4 + 1 / 2) * 32 * size)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("target", ["Replicate", "Shard(0)"])
@pytest.mark.parametrize("op", sorted(TORCH_BOOL["results"]))
def test_a_partial_of_bools_reduces_as_torchs(op, target, graph):
    """torch's gloo/NCCL reduce bools: sum and max are a logical or, min and product a logical and,
    avg is refused.  Partial on mesh dim 'a' (two ranks, torch's two locals), Replicate on 'b'."""
    locals_ = [tf.constant(TORCH_BOOL["locals"][i // 4]) for i in range(8)]  # device i sits at a = i // 4
    d = DTensor.from_local(locals_, MESH, [Partial(op), Replicate()])
    to = [Replicate(), Replicate()] if target == "Replicate" else [Shard(0), Replicate()]
    reduce = (lambda t: t.redistribute(MESH, to).full_tensor())
    reduce = tf.function(reduce) if graph else reduce
    want = TORCH_BOOL["results"][op]
    if "error" in want:  # torch: "result type Float can't be cast to the desired output type Bool"
        with pytest.raises(TypeError, match=r"Partial\('avg'\) DTensor of dtype bool"):
            reduce(d)
        return
    out = reduce(d)
    assert out.dtype == tf.bool and want["dtype"] == "torch.bool"
    np.testing.assert_array_equal(out.numpy(), np.array(want["value"]))
