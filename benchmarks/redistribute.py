"""Each redistribute transition on 8 virtual CPUs: bytes and time, tfdist vs raw TF DTensor.

For 1-D meshes of 4 and 8 devices and a 2x4 mesh, even and uneven shapes,
every transition of torch's table (and the 2-D ones FSDP and TP use):

- the collectives each program ran (CommDebugMode, from the TF profiler),
- the bytes each device sends, read by CommDebugMode from the programs TF
  executed (each collective's output shape, dtype and group size, ring
  costs), for tfdist and for the raw program, against torch's minimal plan
  (written out per case) and against tfdist's own plan (``explain_redistribute``);
- the median time of ``DTensor.redistribute`` in a tf.function against the
  same move written directly with ``tf.experimental.dtensor`` as a TF user
  writes it (one relayout, TF's default lowering), timed in interleaved rounds.

Run: python benchmarks/redistribute.py [--n 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfdist  # noqa: E402

tfdist.virtual_cpus(8)

from _common import print_table, write_results  # noqa: E402
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from tfdist.tensor._redistribute import relayout  # noqa: E402
from tfdist.tensor.debug import CommDebugMode, explain_redistribute  # noqa: E402

U = dtensor.UNSHARDED
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
_GATHER_SWITCH = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"

# (name, src, dst, the raw program's target layout, torch's minimal bytes as a fraction of the tensor)
# 1-D, k devices: all-gather (k-1)/k, all-to-all (k-1)/k^2, reduce-scatter (k-1)/k, all-reduce 2(k-1)/k.
ONE_D = [
    ("S(0)->R", (S0,), (R,), [U, U], lambda k: (k - 1) / k),
    ("S(0)->S(1)", (S0,), (S1,), [U, "x"], lambda k: (k - 1) / k**2),
    ("R->S(0)", (R,), (S0,), ["x", U], lambda k: 0.0),
    ("P->R", (P,), (R,), [U, U], lambda k: 2 * (k - 1) / k),
    ("P->S(0)", (P,), (S0,), ["x", U], lambda k: (k - 1) / k),
]
# 2x4 (dp, tp), torch's plan mesh dim by mesh dim, worked out by hand (N = the tensor's bytes):
#   S0,S1->R,R    gather tp (3 x N/8), then dp (1 x N/2)                          = 7/8
#   S0,S1->S1,S0  dp S0->S1 waits (dim 1 is tp's): gather dp (1 x N/8), tp S1->S0
#                 all-to-all (3/4 x N/4), then a local slice                       = 5/16
#   R,P->R,S0     reduce-scatter over tp of N                                      = 3/4
#   P,P->R,R      all-reduce over dp (2 x 1/2 N), then tp (2 x 3/4 N)              = 5/2
#   P,R->S0,R     reduce-scatter over dp of N                                      = 1/2
#   S0,R->R,S0    gather dp (1 x N/2); tp R->S0 is local                           = 1/2
TWO_D = [
    ("S0,S1->R,R", (S0, S1), (R, R), [U, U], 7 / 8),
    ("S0,S1->S1,S0", (S0, S1), (S1, S0), ["tp", "dp"], 5 / 16),
    ("R,P->R,S0", (R, P), (R, S0), ["tp", U], 3 / 4),
    ("P,P->R,R", (P, P), (R, R), [U, U], 5 / 2),
    ("P,R->S0,R", (P, R), (S0, R), ["dp", U], 1 / 2),
    ("S0,R->R,S0", (S0, R), (R, S0), ["tp", U], 1 / 2),
]


def make_source(x: np.ndarray, mesh, placements) -> DTensor:
    """x laid out as ``placements``; Partial(sum) parts are x / (devices holding parts)."""
    if not any(p.is_partial() for p in placements):
        return distribute_tensor(x, mesh, placements)
    k = int(np.prod([mesh.shape[m] for m, p in enumerate(placements) if p.is_partial()]))
    plain = distribute_tensor(x / k, mesh, [R if p.is_partial() else p for p in placements])
    return DTensor.from_local(plain.local_tensors(), mesh, placements, shape=x.shape)


def raw_program(d: DTensor, specs: list[str], partial_axes: int):
    """The move as a TF DTensor user writes it: reduce the Partial axes, one relayout."""
    mesh = d.device_mesh.root_mesh.to_tf()

    def fn(t):
        if partial_axes:
            t = tf.reduce_sum(t, axis=list(range(partial_axes)))
        return dtensor.relayout(t, dtensor.Layout(specs, mesh))

    return tf.function(fn)


def _sync(result):
    value = result._physical if isinstance(result, DTensor) else result
    for t in dtensor.unpack(value):
        t.numpy()


def interleaved(fns: dict[str, callable], rounds: int, per_round: int = 5) -> dict[str, float]:
    """Median ms per call of each fn, timed alternately in rounds (fair under load)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_round):
                start = time.perf_counter()
                _sync(fn())
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def counted(fn) -> tuple[dict[str, int], float]:
    """(collectives per device, bytes each device sent) as TF executed them."""
    with CommDebugMode() as comm:
        _sync(fn())
    assert not comm.get_unmeasured_counts(), comm.get_unmeasured_counts()
    return comm.get_comm_counts(), sum(comm.get_comm_bytes().values())


def run_case(mesh, name, src, dst, specs, minimal_fraction, shape, rounds, dtype="float32"):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    if dtype != "float32":  # 1-byte types: small integers (bool: their sign)
        x = (x > 0) if dtype == "bool" else np.clip(np.round(x * 40), -128, 127).astype(dtype)
    d = make_source(x, mesh, src)
    ours = tf.function(lambda t: t.redistribute(mesh, dst))
    np.testing.assert_array_equal(ours(d).full_tensor().numpy(), x) if dtype != "float32" else \
        np.testing.assert_allclose(ours(d).full_tensor().numpy(), x, atol=1e-4)
    planned = sum(s.bytes_per_device for s in explain_redistribute(d, mesh, dst))
    least = minimal_fraction * x.nbytes
    kernels, executed = counted(lambda: ours(d))
    row = {
        "mesh": "x".join(map(str, mesh.shape)), "transition": name, "shape": "x".join(map(str, shape)),
        "dtype": dtype, "tfdist_kernels": _fmt(kernels),
        "tfdist_MB": round(executed / 2**20, 3), "planned_MB": round(planned / 2**20, 3),
        "torch_min_MB": round(least / 2**20, 3),
        "bytes_vs_torch": "-" if least == executed == 0 else (round(executed / least, 3) if least else "inf"),
    }
    fns = {"tfdist": lambda: ours(d)}
    if all(n % 8 == 0 for n in shape):  # TF DTensor refuses uneven shards: no raw program
        theirs = raw_program(d, specs, sum(p.is_partial() for p in src))
        saved = os.environ.pop(_GATHER_SWITCH, None)  # compiled with TF's default lowering
        try:
            raw = theirs(d._physical)
        finally:
            if saved is not None:
                os.environ[_GATHER_SWITCH] = saved
        # gathered one mesh dim at a time: TF mis-lowers a two-dim gather (docs/tf_dtensor_repros)
        full = relayout(raw, dtensor.Layout.replicated(dtensor.fetch_layout(raw).mesh, 2))
        np.testing.assert_allclose(dtensor.unpack(full)[0].numpy().astype(np.float32), x.astype(np.float32),
                                   atol=1e-4, err_msg=f"raw TF {name}")
        raw_kernels, raw_bytes = counted(lambda: theirs(d._physical))
        row["raw_kernels"], row["raw_MB"] = _fmt(raw_kernels), round(raw_bytes / 2**20, 3)
        fns["raw"] = lambda: theirs(d._physical)
    times = interleaved(fns, rounds)
    row["tfdist_ms"] = round(times["tfdist"], 3)
    row["raw_ms"] = round(times["raw"], 3) if "raw" in times else "n/a"
    row["time_ratio"] = round(times["tfdist"] / times["raw"], 3) if "raw" in times else "n/a"
    return row


def _fmt(counts: dict[str, int]) -> str:
    return ",".join(f"{k}x{v}" for k, v in counts.items()) or "none"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = args.n
    rows = []
    for devices in (4, 8):
        mesh = tfdist.DeviceMesh("cpu", list(range(devices)), mesh_dim_names=("x",))
        for shape in ((n, n), (n - 3, n)):
            for name, src, dst, specs, minimal in ONE_D:
                rows.append(run_case(mesh, name, src, dst, specs, minimal(devices), shape, args.rounds))
        for dtype in ("int8", "uint8", "bool"):  # TF gathers no 1-byte type; tfdist packs pairs
            rows.append(run_case(mesh, "S(0)->R", (S0,), (R,), [U, U], (devices - 1) / devices, (n, n),
                                 args.rounds, dtype))
    mesh2 = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    for shape in ((n, n), (n - 3, n)):
        for name, src, dst, specs, minimal in TWO_D:
            rows.append(run_case(mesh2, name, src, dst, specs, minimal, shape, args.rounds))
    path = write_results("redistribute", rows, {"devices": "8 virtual CPUs", "n": n, "rounds": args.rounds})
    print_table(rows, ["mesh", "transition", "shape", "dtype", "tfdist_kernels", "raw_kernels", "tfdist_MB", "planned_MB",
                       "raw_MB", "torch_min_MB", "bytes_vs_torch", "tfdist_ms", "raw_ms", "time_ratio"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
