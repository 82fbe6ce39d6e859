"""CommDebugMode: count the collectives TensorFlow actually executes.

tfdist does not trust its own plans here: TF DTensor chooses the kernels
when it SPMD-expands a program (see docs/performance.md).  So the counts
come from the TensorFlow profiler: while the mode is active the profiler
records every kernel each device runs; on exit the trace (an ``XSpace``
protobuf that TensorFlow ships) is parsed and each collective kernel
(``CollectiveReduceV2``, ``CollectiveGatherV2``, ``CollectiveAllToAllV2``,
``CollectiveReduceScatterV2``, broadcast send/recv, NCCL kernels) is
counted once per launch: the devices of one collective share its
(step_id, instance_key), so a count is *per device* -- torch's per-rank
count -- on a mesh of any size.

Per-module counts: TF DTensor's SPMD expansion drops name scopes from the
collective ops, so modules are attributed by tfdist itself -- code inside
``with comm_mode.module("block0"):`` (eager execution) is counted under
"block0".
"""

from __future__ import annotations

import collections
import contextlib
import glob
import shutil
import tempfile
from typing import Iterator

import tensorflow as tf
from tensorflow.python.eager import context

__all__ = ["CommDebugMode", "classify_kernel"]

# TF op type (or NCCL/XLA kernel name, lower-cased) -> torch's functional-collective name
# (torch.distributed._functional_collectives: what torch's CommDebugMode counts).
_KERNELS = (
    ("reducescatter", "reduce_scatter_tensor"),
    ("reduce-scatter", "reduce_scatter_tensor"),
    ("alltoall", "all_to_all_single"),
    ("all-to-all", "all_to_all_single"),
    ("gather", "all_gather_into_tensor"),
    ("all-gather", "all_gather_into_tensor"),
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


def _read_kernel_counts(logdir: str) -> tuple[collections.Counter, collections.Counter]:
    """(launches, executions) per collective kernel type found in the trace.

    An execution is one device running the kernel.  A launch is one
    collective of the SPMD program: every device of its group runs it under
    the same (step_id, instance_key), so distinct pairs count launches --
    per device, whatever the mesh size, and robust to the profiler dropping
    some devices' events.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    counts: collections.Counter = collections.Counter()
    launches: dict[str, set] = collections.defaultdict(set)
    for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if not plane.name.startswith("/host:"):
                continue  # device planes repeat what the host's TF ops record
            names = {k: v.name for k, v in plane.event_metadata.items()}
            stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    name = names.get(event.metadata_id, "")
                    if ":" in name:  # TF op events are "op_name:OpType"
                        op_type = name.rsplit(":", 1)[1]
                        if classify_kernel(op_type):
                            counts[op_type] += 1
                            stats = {stat_names.get(s.metadata_id): s.int64_value or s.uint64_value
                                     for s in event.stats}
                            key = (stats.get("step_id"), stats.get("instance_key"))
                            # NCCL/XLA kernels carry no keys: each execution stands alone
                            launches[op_type].add(key if None not in key else (id(event),))
    return collections.Counter({k: len(v) for k, v in launches.items()}), counts


class CommDebugMode:
    """Counts the collectives executed by the code inside ``with``.

    Example::

        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Replicate(), Replicate()])
        comm.get_comm_counts()   # {'all_gather_into_tensor': 1}
        print(comm.generate_comm_debug_tracing_table())
    """

    def __init__(self) -> None:
        self._launches: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
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
            launches, executions = _read_kernel_counts(self._logdir)
            self._launches[self._module].update(launches)
            self._kernels[self._module].update(executions)
        finally:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

    def __enter__(self) -> CommDebugMode:
        self._kernels.clear()
        self._launches.clear()
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
    @staticmethod
    def _by_torch_name(launches: collections.Counter) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for op_type, n in launches.items():
            out[classify_kernel(op_type)] += n
        return dict(sorted(out.items()))

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives per device by torch's names.

        Names are torch's functional collectives: ``all_reduce``,
        ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
        ``all_to_all_single`` (and ``broadcast``, ``send_recv``).  A count is
        the number of collectives each participating device ran, whatever
        the mesh size.  tfdist's reduce-scatter (Partial -> Shard) runs as
        an all-to-all kernel that moves reduce-scatter bytes, and is counted
        as ``all_to_all_single``.
        """
        total: collections.Counter = collections.Counter()
        for launches in self._launches.values():
            total.update(launches)
        return self._by_torch_name(total)

    def get_total_counts(self) -> int:
        """All collectives per device."""
        return sum(self.get_comm_counts().values())

    def get_comm_module_counts(self) -> dict[str, dict[str, int]]:
        """Per-module collective counts (modules marked with :meth:`module`)."""
        return {m: self._by_torch_name(k) for m, k in self._launches.items() if k}

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
