"""Shared helpers for the benchmarks: timing and JSON + table output."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time
from typing import Callable

RESULTS = pathlib.Path(__file__).parent / "results"


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


def write_results(name: str, rows: list[dict], meta: dict) -> pathlib.Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, **meta, "rows": rows}
    path.write_text(json.dumps(payload, indent=1))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)))
