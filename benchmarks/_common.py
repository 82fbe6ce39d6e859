"""Shared helpers for the benchmarks: timing and JSON + table output."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time
from typing import Callable

import numpy as np

# run_all.py --quick points this elsewhere, so that a short run never overwrites the committed results
RESULTS = pathlib.Path(os.environ.get("TFDIST_BENCH_RESULTS") or pathlib.Path(__file__).parent / "results")


def time_call(fn: Callable[[], object], sync: Callable[[object], None], *, warmup: int = 3, repeat: int = 15) -> float:
    """Median wall time of ``fn`` in milliseconds, after ``warmup`` calls."""
    for _ in range(warmup):
        sync(fn())
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        sync(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


ENV_PREFIXES = ("TF_", "XLA_", "KERAS_", "JAX_", "OMP_", "MKL_", "TFDIST_", "CUDA_", "ONEDNN_", "DNNL_")


def env_switches() -> dict[str, str]:
    """The environment switches a run was given (TF, XLA, Keras, JAX, threading, oneDNN)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def host() -> dict:
    """The machine a result was measured on: CPU model, cores, Python, OS, environment switches."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "env": env_switches()}


def write_results(name: str, rows: list[dict], meta: dict) -> pathlib.Path:
    path = RESULTS / f"{name}.json"  # name may hold a folder: "changes/before_after_<base>"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": host(), **meta, "rows": rows}
    path.write_text(json.dumps(payload, indent=1))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)))


# Bytes a device sends for one collective of output size O over a group of k (ring algorithms).
_WIRE = {
    "CollectiveGatherV2": lambda out, k: (k - 1) / k * out,
    "CollectiveReduceV2": lambda out, k: 2 * (k - 1) / k * out,
    "CollectiveAllToAllV2": lambda out, k: (k - 1) / k * out,
    "CollectiveReduceScatterV2": lambda out, k: (k - 1) * out,
}


def largest_tensor_bytes(fn: Callable[[], object], device: str = "CPU:0") -> int:
    """The largest tensor any op of ``fn``'s program produces on ``device`` (bytes)."""
    import tensorflow as tf

    from tfdist.tensor.debug._executed import partition_graphs

    largest = 0
    for graph in partition_graphs(fn):
        for node in graph.node:
            if not node.device.endswith(device) or "_output_shapes" not in node.attr:
                continue
            dtype = node.attr["T"].type if "T" in node.attr else node.attr["dtype"].type if "dtype" in node.attr else 0
            itemsize = tf.dtypes.as_dtype(dtype).size if dtype else 4
            for shape in node.attr["_output_shapes"].list.shape:
                dims = [d.size for d in shape.dim]
                if dims and min(dims) >= 0:
                    largest = max(largest, int(np.prod(dims)) * itemsize)
    return largest


def executed_collective_bytes(fn: Callable[[], object], device: str = "CPU:0") -> dict[str, float]:
    """Bytes ``device`` sends per call of ``fn``, by collective kernel, read from what TF ran.

    ``fn`` must call a ``tf.function`` not yet run: TF exports the partition
    graphs (the per-device programs DTensor's SPMD expansion produced, with
    every collective's output shape and group size) once per function
    instantiation.  The wire bytes per collective use the ring formulas above.
    """
    import tensorflow as tf

    from tfdist.tensor.debug._executed import partition_graphs

    sent: dict[str, float] = {}
    for graph in partition_graphs(fn):
        nodes = {n.name: n for n in graph.node}
        for node in graph.node:
            if node.op not in _WIRE or not node.device.endswith(device):
                continue
            shape = [d.size for d in node.attr["_output_shapes"].list.shape[0].dim]
            itemsize = tf.dtypes.as_dtype(node.attr["T"].type).size
            group = tf.make_ndarray(nodes[node.input[1].split(":")[0]].attr["value"].tensor)
            out = float(np.prod(shape)) * itemsize
            sent[node.op] = sent.get(node.op, 0.0) + _WIRE[node.op](out, int(group))
    return sent
