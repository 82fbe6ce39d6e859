"""A pipeline step as the TensorFlow profiler saw it.

``step()`` names each action in the profiler (a ``TraceMe`` annotation on its
rank's thread), so a trace taken with ``tf.profiler.experimental.start`` /
``stop`` holds each rank's actions and, beside them, the kernels TF ran: on
CPU the executor's op events on its compute threads, on GPU/TPU the events
of the device planes.  ``read_profile`` reads that trace (the ``.xplane.pb``
file TensorBoard reads) into per-rank action intervals and kernel intervals.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

from tensorflow.tsl.profiler.protobuf import xplane_pb2

__all__ = ["PipelineProfile", "read_profile"]

_HOST_PLANE = "/host:CPU"
_DEVICE_PLANES = ("/device:GPU:", "/device:TPU:")
_CPU_KERNEL_THREADS = ("tf_Compute", "tf_inter_op")


@dataclasses.dataclass
class PipelineProfile:
    """What ran, in seconds from the first action's start.

    ``actions[rank]``: ``(action, start, end)`` per pipeline rank, as annotated by ``step()``;
    ``kernels``: ``(where, name, start, end)``, ``where`` a compute thread or a device stream.
    """

    actions: dict[int, list[tuple[str, float, float]]]
    kernels: list[tuple[str, str, float, float]]

    def concurrency(self) -> float:
        """Pipeline ranks busy at once, on average over the step (1.0: no overlap at all)."""
        spans = [(s, e) for acts in self.actions.values() for _, s, e in acts]
        return sum(e - s for s, e in spans) / (max(e for _, e in spans) - min(s for s, _ in spans))

    def kernel_overlap(self) -> float:
        """Of the time any kernel runs, the share during which two or more run at once."""
        edges = sorted([(s, 1) for _, _, s, _ in self.kernels] + [(e, -1) for _, _, _, e in self.kernels])
        running, last, busy, parallel = 0, None, 0.0, 0.0
        for t, change in edges:
            if last is not None and running:
                busy += t - last
                parallel += (t - last) if running > 1 else 0.0
            running, last = running + change, t
        return parallel / busy if busy else 0.0


def _stats(event: Any, plane: Any) -> dict[str, Any]:
    out = {}
    for stat in list(event.stats) + list(plane.event_metadata[event.metadata_id].stats):
        kind = stat.WhichOneof("value")
        value = getattr(stat, kind) if kind else None
        if kind == "ref_value":
            value = plane.stat_metadata[value].name
        out[plane.stat_metadata[stat.metadata_id].name] = value
    return out


def _newest_trace(logdir: str | os.PathLike) -> pathlib.Path:
    traces = sorted(pathlib.Path(logdir).glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(
            f"read_profile: no profiler trace (plugins/profile/*/*.xplane.pb) under logdir={os.fspath(logdir)!r}; "
            "run the step between tf.profiler.experimental.start(logdir) and tf.profiler.experimental.stop()."
        )
    return traces[-1]


def _events(plane: Any, line: Any):
    for event in line.events:
        start = line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
        yield plane.event_metadata[event.metadata_id].name, event, start, start + event.duration_ps * 1e-12


def read_profile(logdir: str | os.PathLike) -> PipelineProfile:
    """The newest profiler trace under ``logdir``, as pipeline actions and kernels.

    Example::

        tf.profiler.experimental.start("/tmp/pp")
        schedule.step(x, target=y)
        tf.profiler.experimental.stop()
        profile = read_profile("/tmp/pp")
        profile.concurrency()          # ranks busy at once, on average
    """
    space = xplane_pb2.XSpace()
    space.ParseFromString(_newest_trace(logdir).read_bytes())
    actions: dict[int, list[tuple[str, float, float]]] = {}
    kernels: list[tuple[str, str, float, float]] = []
    for plane in space.planes:
        on_device = plane.name.startswith(_DEVICE_PLANES)
        if plane.name != _HOST_PLANE and not on_device:
            continue
        for line in plane.lines:
            cpu_kernels = line.name.startswith(_CPU_KERNEL_THREADS)
            for name, event, start, end in _events(plane, line):
                if on_device:
                    kernels.append((f"{plane.name} {line.name}", name, start, end))
                    continue
                rank = _stats(event, plane).get("pipeline_rank")
                if rank is not None:
                    actions.setdefault(int(rank), []).append((name, start, end))
                elif cpu_kernels and ":" in name and not name.startswith(("Threadpool", "Executor")):
                    kernels.append((line.name, name, start, end))  # "<op path>:<op type>"
    if not actions:
        raise ValueError(f"read_profile: the trace under {os.fspath(logdir)!r} holds no pipeline actions; "
                         "profile a schedule's step() or eval().")
    t0 = min(s for acts in actions.values() for _, s, _ in acts)
    actions = {r: sorted(((a, s - t0, e - t0) for a, s, e in acts), key=lambda x: x[1])
               for r, acts in sorted(actions.items())}
    kernels = sorted(((w, n, s - t0, e - t0) for w, n, s, e in kernels), key=lambda k: k[2])
    return PipelineProfile(actions, kernels)
