"""CommDebugMode: count the collectives TensorFlow actually executes.

tfdist does not trust its own plans here: TF DTensor chooses the kernels
when it SPMD-expands a program, and on CPU it lowers an all-gather or a
reduce-scatter to an all-reduce (see docs/performance.md).  So the counts
come from the TensorFlow profiler: while the mode is active the profiler
records every kernel each device runs; on exit the trace (an ``XSpace``
protobuf that TensorFlow ships) is parsed and each collective kernel
(``CollectiveReduceV2``, ``CollectiveGatherV2``, ``CollectiveAllToAllV2``,
``CollectiveReduceScatterV2``, broadcast send/recv, NCCL kernels) is
counted.  Every device of an SPMD program runs each collective once, so a
count is *per device* -- torch's per-rank count.

Per-module counts: TF DTensor's SPMD expansion drops name scopes from the
collective ops, so modules are attributed by tfdist itself -- code inside
``with comm_mode.module("block0"):`` (eager execution) is counted under
"block0".
"""

from __future__ import annotations

import collections
import contextlib
import glob
import math
import shutil
import tempfile
from typing import Iterator

import tensorflow as tf
from tensorflow.python.eager import context

from tfdist import _runtime

__all__ = ["CommDebugMode", "classify_kernel"]

# TF op type (or NCCL/XLA kernel name, lower-cased) -> torch's collective name.
_KERNELS = (
    ("reducescatter", "reduce_scatter"),
    ("reduce-scatter", "reduce_scatter"),
    ("alltoall", "all_to_all"),
    ("all-to-all", "all_to_all"),
    ("gather", "all_gather"),
    ("all-gather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("all-reduce", "all_reduce"),
    ("collectivereduce", "all_reduce"),
    ("bcast", "broadcast"),
    ("collective-permute", "send_recv"),
    ("collectivepermute", "send_recv"),
)


def classify_kernel(op_type: str) -> str | None:
    """torch's name for a collective kernel type, or None for other kernels."""
    low = op_type.lower()
    if not ("collective" in low or "nccl" in low or "all-" in low or "alltoall" in low):
        return None
    for needle, name in _KERNELS:
        if needle in low:
            return name
    return None


def _sync() -> None:
    # Eager DTensor ops and functions may still be running; their kernels
    # must land inside (or outside) the profiled window, not straddle it.
    context.async_wait()


def _read_kernel_counts(logdir: str) -> collections.Counter:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    counts: collections.Counter = collections.Counter()
    for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if not plane.name.startswith("/host:"):
                continue  # device planes repeat what the host's TF ops record
            names = {k: v.name for k, v in plane.event_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    name = names.get(event.metadata_id, "")
                    if ":" in name:  # TF op events are "op_name:OpType"
                        op_type = name.rsplit(":", 1)[1]
                        if classify_kernel(op_type):
                            counts[op_type] += 1
    return counts


class CommDebugMode:
    """Counts the collectives executed by the code inside ``with``.

    Args:
        num_devices: devices taking part in each collective's SPMD program,
            used to turn kernel executions into per-device counts; default
            this client's devices of the detected device type.

    Example::

        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Replicate(), Replicate()])
        comm.get_comm_counts()   # {'all_reduce': 1} on CPU: TF's all-gather lowering
        print(comm.generate_comm_debug_tracing_table())
    """

    def __init__(self, num_devices: int | None = None) -> None:
        if num_devices is None:
            num_devices = len(_runtime.local_devices(_runtime.detect_device_type()))
        self._num_devices = max(1, int(num_devices))
        self._kernels: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._module = "Global"
        self._logdir: str | None = None

    # -- profiling window -------------------------------------------------------
    def _start(self) -> None:
        _sync()
        self._logdir = tempfile.mkdtemp(prefix="tfdist_comm_")
        try:
            tf.profiler.experimental.start(self._logdir)
        except tf.errors.AlreadyExistsError as err:
            shutil.rmtree(self._logdir, ignore_errors=True)
            raise RuntimeError(
                "CommDebugMode needs the TensorFlow profiler, which is already "
                "running (another CommDebugMode or tf.profiler session); stop it first."
            ) from err

    def _stop(self) -> None:
        _sync()
        tf.profiler.experimental.stop()
        try:
            self._kernels[self._module].update(_read_kernel_counts(self._logdir))
        finally:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

    def __enter__(self) -> CommDebugMode:
        self._kernels.clear()
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    @contextlib.contextmanager
    def module(self, name: str) -> Iterator[None]:
        """Attributes what runs inside (eagerly) to module ``name``."""
        outer = self._module
        self._stop()
        self._module = name
        self._start()
        try:
            yield
        finally:
            self._stop()
            self._module = outer
            self._start()

    # -- results ----------------------------------------------------------------
    def _per_device(self, kernels: collections.Counter) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for op_type, executions in kernels.items():
            out[classify_kernel(op_type)] += executions
        # ceil: the profiler may drop a device's event on a function's very first run
        return {k: math.ceil(v / self._num_devices) for k, v in sorted(out.items())}

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives per device by torch name (all_reduce, all_gather, ...)."""
        total: collections.Counter = collections.Counter()
        for kernels in self._kernels.values():
            total.update(kernels)
        return self._per_device(total)

    def get_total_counts(self) -> int:
        """All collectives per device."""
        return sum(self.get_comm_counts().values())

    def get_comm_module_counts(self) -> dict[str, dict[str, int]]:
        """Per-module collective counts (modules marked with :meth:`module`)."""
        return {m: self._per_device(k) for m, k in self._kernels.items() if k}

    def get_kernel_counts(self) -> dict[str, int]:
        """Raw executions per TF kernel type, summed over devices."""
        total: collections.Counter = collections.Counter()
        for kernels in self._kernels.values():
            total.update(kernels)
        return dict(total)

    def generate_comm_debug_tracing_table(self, noise_level: int = 0) -> str:
        """A readable table: module, collective, count per device (and kernels at noise_level >= 1)."""
        rows = [("module", "collective", "per device")]
        for module, counts in self.get_comm_module_counts().items():
            for name, n in counts.items():
                rows.append((module, name, str(n)))
        if noise_level >= 1:
            rows.append(("", "", ""))
            rows.append(("TF kernel", "executions", "(all devices)"))
            rows += [(k, str(v), "") for k, v in sorted(self.get_kernel_counts().items())]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"total: {self.get_total_counts()} collective(s) per device")
        return "\n".join(lines)
