"""Each redistribute transition on 8 virtual CPUs: time and bytes, tfdist vs raw TF DTensor.

For every transition and size it reports
- the median time of ``DTensor.redistribute`` inside a tf.function, and of
  the same move written directly with ``tf.experimental.dtensor`` (ratio
  tfdist / raw: the cost of the tfdist layer),
- the collectives TensorFlow executed (CommDebugMode) and the bytes per
  device they move (ring algorithms) against the minimum for torch's
  collective for that transition.

Run: python benchmarks/redistribute.py [--sizes 256 1024 2048]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfdist  # noqa: E402

tfdist.virtual_cpus(8)

from _common import print_table, time_call, write_results  # noqa: E402
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from tfdist.tensor.debug import CommDebugMode  # noqa: E402

K = 8


def ring_bytes(collective: str, n_bytes: int, k: int = K) -> float:
    """Bytes each device sends for one collective over a buffer of ``n_bytes`` (the full tensor)."""
    return {
        "all_reduce": 2 * (k - 1) / k * n_bytes,
        "all_gather": (k - 1) / k * n_bytes,
        "reduce_scatter": (k - 1) / k * n_bytes,
        "all_to_all": (k - 1) / k * n_bytes / k,
        "none": 0.0,
    }[collective]


def transitions(mesh, n):
    x = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    tf_mesh = mesh.to_tf()
    U = dtensor.UNSHARDED

    def raw(spec):
        return dtensor.Layout(spec, tf_mesh)

    parts = [x / K for _ in range(K)]
    cases = [
        ("S(0)->R", distribute_tensor(x, mesh, [Shard(0)]), [Replicate()], "all_gather",
         lambda t: dtensor.relayout(t, raw([U, U]))),
        ("S(0)->S(1)", distribute_tensor(x, mesh, [Shard(0)]), [Shard(1)], "all_to_all",
         lambda t: dtensor.relayout(t, raw([U, "x"]))),
        ("R->S(0)", distribute_tensor(x, mesh, [Replicate()]), [Shard(0)], "none",
         lambda t: dtensor.relayout(t, raw(["x", U]))),
        ("P->R", DTensor.from_local(parts, mesh, [Partial()]), [Replicate()], "all_reduce",
         lambda t: tf.reduce_sum(t, 0)),
        ("P->S(0)", DTensor.from_local(parts, mesh, [Partial()]), [Shard(0)], "reduce_scatter",
         lambda t: dtensor.relayout(tf.reduce_sum(t, 0), raw(["x", U]))),
    ]
    return x.nbytes, cases


def _sync(result):
    value = result._physical if isinstance(result, DTensor) else result
    for t in dtensor.unpack(value):
        t.numpy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048])
    args = parser.parse_args()
    mesh = tfdist.init_device_mesh("cpu", (K,), mesh_dim_names=("x",))
    rows = []
    for n in args.sizes:
        n_bytes, cases = transitions(mesh, n)
        for name, d, dst, minimal, raw_fn in cases:
            ours = tf.function(lambda t, dst=dst: t.redistribute(mesh, dst))
            theirs = tf.function(raw_fn)
            t_ours = time_call(lambda: ours(d), _sync)
            t_raw = time_call(lambda: theirs(d._physical), _sync)
            with CommDebugMode() as comm:
                _sync(ours(d))
            executed = comm.get_comm_counts()
            moved = sum(ring_bytes(c, n_bytes) * m for c, m in executed.items())
            least = ring_bytes(minimal, n_bytes)
            rows.append({
                "transition": name, "n": n, "tfdist_ms": round(t_ours, 3), "raw_ms": round(t_raw, 3),
                "ratio": round(t_ours / t_raw, 3), "executed": ",".join(f"{k}x{v}" for k, v in executed.items()) or "none",
                "minimal": minimal, "MB_moved": round(moved / 2**20, 3), "MB_minimal": round(least / 2**20, 3),
                "excess": "-" if least == moved else (f"{moved / least:.1f}x" if least else "inf"),
            })
    path = write_results("redistribute", rows, {"mesh": [K], "devices": "virtual CPU"})
    print_table(rows, ["transition", "n", "tfdist_ms", "raw_ms", "ratio", "executed", "minimal", "MB_moved", "MB_minimal", "excess"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
