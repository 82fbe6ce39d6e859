"""CommDebugMode: count the collectives TensorFlow actually executes, and their bytes.

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

Bytes: the trace's kernel events carry no tensor sizes, but it names every
function each device executed (``EagerExecute`` events).  TF keeps the
SPMD-expanded per-device program of each in the eager context, where every
collective node records its output shape, dtype and group size; the bytes a
device sends are those, with ring costs, times the calls in the trace.

Logical names: tfdist's reduce-scatter runs as an all-to-all kernel; it is
counted as ``reduce_scatter_tensor`` by its name scope (in ``tf.function``)
or by tfdist's report of the eager execution (``tfdist.tensor._comm_events``).

Per-module counts: TF DTensor's SPMD expansion drops name scopes from the
collective ops, so modules are attributed by tfdist itself -- code inside
``with comm_mode.module("block0"):`` (eager execution) is counted under
"block0".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import shutil
import tempfile
from typing import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from tfdist.tensor import _comm_events
from tfdist.tensor.debug._executed import function_nodes

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

# Bytes one device sends for a collective whose output on that device is
# ``out`` bytes, over a group of k (ring algorithms, as in torch's cost model).
_WIRE = {
    "CollectiveGatherV2": lambda out, k: (k - 1) / k * out,
    "CollectiveReduceV2": lambda out, k: 2 * (k - 1) / k * out,
    "CollectiveAllToAllV2": lambda out, k: (k - 1) / k * out,
    "CollectiveReduceScatterV2": lambda out, k: (k - 1) * out,
    "CollectiveBcastSendV2": lambda out, k: out,
    "CollectiveBcastRecvV2": lambda out, k: 0.0,
}


def classify_kernel(op_type: str) -> str | None:
    """torch's name for a collective kernel type, or None for other kernels."""
    low = op_type.lower()
    if not ("collective" in low or "nccl" in low or "all-" in low or "alltoall" in low):
        return None
    for needle, name in _KERNELS:
        if needle in low:
            return name
    return None


def _logical_name(node_path: str, op_type: str) -> str | None:
    """torch's name for the collective a kernel serves, by its type.

    tfdist's own collectives built from another kernel (its reduce-scatter
    is an all-to-all) are renamed afterwards, see ``CommDebugMode._relabel``.
    """
    return classify_kernel(op_type)


def _sync() -> None:
    # Eager DTensor ops and functions may still be running; their kernels
    # must land inside (or outside) the profiled window, not straddle it.
    context.async_wait()


@dataclasses.dataclass
class _Trace:
    launches: collections.Counter  # torch name -> collectives per device
    kernels: collections.Counter  # TF kernel type -> executions, all devices
    calls: collections.Counter  # executed function -> calls per device


def _stat_value(stat, stat_names: dict) -> object:
    if stat.HasField("ref_value"):  # interned strings live in the stat metadata
        return stat_names.get(stat.ref_value)
    return stat.str_value or stat.int64_value or stat.uint64_value


def _read_trace(logdir: str) -> _Trace:
    """Collective launches and kernels, and the functions each device ran, from the trace.

    An execution is one device running a kernel.  A launch is one
    collective of the SPMD program: every device of its group runs it under
    the same (step_id, instance_key), so distinct pairs count launches --
    per device, whatever the mesh size, and robust to the profiler dropping
    some devices' events.  Function calls likewise: the most calls any one
    device thread recorded.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    kernels: collections.Counter = collections.Counter()
    launches: dict[str, set] = collections.defaultdict(set)
    calls_per_line: dict[tuple, int] = collections.Counter()
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
                    if name == "EagerExecute":
                        stats = {stat_names.get(s.metadata_id): _stat_value(s, stat_names) for s in event.stats}
                        if stats.get("is_func") and stats.get("eager_op"):
                            calls_per_line[(path, plane.id, line.id, stats["eager_op"])] += 1
                    elif ":" in name:  # TF op events are "op_name:OpType"
                        node_path, op_type = name.rsplit(":", 1)
                        logical = _logical_name(node_path, op_type)
                        if logical:
                            kernels[op_type] += 1
                            stats = {stat_names.get(s.metadata_id): s.int64_value or s.uint64_value
                                     for s in event.stats}
                            key = (stats.get("step_id"), stats.get("instance_key"))
                            # NCCL/XLA kernels carry no keys: each execution stands alone
                            launches[logical].add((op_type, *key) if None not in key else (id(event),))
    calls: collections.Counter = collections.Counter()
    for (*_, function), n in calls_per_line.items():
        calls[function] = max(calls[function], n)
    return _Trace(collections.Counter({k: len(v) for k, v in launches.items()}), kernels, calls)


_FUNCTION_BYTES: dict[str, tuple[collections.Counter, collections.Counter]] = {}


def _function_collectives(name: str) -> tuple[collections.Counter, collections.Counter]:
    """(bytes sent per device, collective nodes) by torch name in one call of function ``name``.

    Read from the SPMD-expanded function TF executed (kept in the eager
    context): each collective node's ``_output_shapes``, dtype and constant
    group size, and the functions it calls.  Cached: a function's body never
    changes under its name.
    """
    if name not in _FUNCTION_BYTES:
        sent: collections.Counter = collections.Counter()
        nodes: collections.Counter = collections.Counter()
        for by_name, node in function_nodes([name]):
            if node.op in _WIRE:
                logical = _logical_name(node.name, node.op)
                nbytes = _node_output_bytes(node)
                k = _constant_input(by_name, node.input[1])
                if logical and nbytes is not None and k is not None:
                    sent[logical] += _WIRE[node.op](nbytes, k)
                    nodes[logical] += 1
        _FUNCTION_BYTES[name] = (sent, nodes)
    return _FUNCTION_BYTES[name]


def _scoped_collectives(executed: str) -> list[tuple[str, str, float, int]]:
    """tfdist's marked collectives in one call of the executed function ``executed``.

    DTensor names the SPMD-expanded function ``<traced name>__func_<hash>``;
    the traced function (kept beside it) still carries tfdist's name scopes
    (``_comm_events.graph_scope``), while the expanded one may not.
    """
    traced = executed.split("__func_")[0]
    if traced == executed:
        return []
    found: list[tuple[str, str, float, int]] = []
    _find_scopes(traced, found, ())
    return found


def _find_scopes(name: str, found: list, stack: tuple) -> None:
    ctx = context.context()
    if name in stack or not ctx.has_function(name):
        return
    marked = set()
    for node in ctx.get_function_def(name).node_def:
        segments = node.name.split("/")[:-1]
        for i, segment in enumerate(segments):
            # TF's gradient of a marked op is scoped "<mark>/<op>_grad": an all-to-all, not the mark
            backward = any(later.endswith("_grad") for later in segments[i + 1:])
            if segment not in marked and not backward and _comm_events.scoped_collective(segment):
                marked.add(segment)
                found.append(_comm_events.scoped_collective(segment))
        for attr in node.attr.values():  # one visit per call site
            for callee in ([attr.func.name] if attr.func.name else [f.name for f in attr.list.func]):
                _find_scopes(callee, found, stack + (name,))


def _node_output_bytes(node) -> float | None:
    shapes = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []
    if not shapes or "T" not in node.attr:
        return None
    dims = [d.size for d in shapes[0].dim]
    if any(d < 0 for d in dims) or shapes[0].unknown_rank:
        return None
    return float(np.prod(dims)) * tf.dtypes.as_dtype(node.attr["T"].type).size


def _constant_input(by_name: dict, ref: str) -> int | None:
    producer = by_name.get(ref.lstrip("^").split(":")[0])
    if producer is None or producer.op != "Const":
        return None
    return int(tf.make_ndarray(producer.attr["value"].tensor))


class CommDebugMode:
    """Counts the collectives executed by the code inside ``with``, and the bytes they send.

    Example::

        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Replicate(), Replicate()])
        comm.get_comm_counts()   # {'all_gather_into_tensor': 1}
        comm.get_comm_bytes()    # {'all_gather_into_tensor': 1536.0}  (per device)
        print(comm.generate_comm_debug_tracing_table())
    """

    def __init__(self) -> None:
        self._launches: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._kernels: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._bytes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._unmeasured: collections.Counter = collections.Counter()
        # tfdist collectives run as another kernel: (module, logical, kernel, out bytes, k, times)
        self._renamed: list[tuple[str, str, str, float, int, int]] = []
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
            self._add(self._module, _read_trace(self._logdir))
        finally:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

    def _add(self, module: str, trace: _Trace) -> None:
        self._launches[module].update(trace.launches)
        self._kernels[module].update(trace.kernels)
        executed: collections.Counter = collections.Counter()
        for function, calls in trace.calls.items():
            sent, nodes = _function_collectives(function)
            for name, n in sent.items():
                self._bytes[module][name] += calls * n
            for name, n in nodes.items():
                executed[name] += calls * n
            for marked in _scoped_collectives(function):
                self._renamed.append((module, *marked, calls))
        for name, n in trace.launches.items():  # launches whose program TF did not expose (XLA)
            if n > executed[name]:
                self._unmeasured[name] += n - executed[name]

    def _on_eager_collective(self, logical: str, kernel: str, output_bytes: float, k: int) -> None:
        self._renamed.append((self._module, logical, kernel, output_bytes, k, 1))

    def __enter__(self) -> CommDebugMode:
        for store in (self._kernels, self._launches, self._bytes):
            store.clear()
        self._unmeasured.clear()
        self._renamed.clear()
        self._start()
        _comm_events.listen(self._on_eager_collective)
        return self

    def __exit__(self, *exc: object) -> None:
        _comm_events.unlisten(self._on_eager_collective)
        self._stop()
        self._relabel()

    def _relabel(self) -> None:
        """Kernels that serve another collective of tfdist's (its reduce-scatter) take its name."""
        for module, logical, kernel, out, k, times in self._renamed:
            plain = classify_kernel(kernel)
            n = min(times, self._launches[module][plain])
            self._launches[module][plain] -= n
            self._launches[module][logical] += n
            if out is None:  # a dynamic shape: the bytes stay under the kernel's own name
                continue
            sent = min(times * _WIRE[kernel](out, k), self._bytes[module][plain])
            self._bytes[module][plain] -= sent
            self._bytes[module][logical] += sent
        self._renamed.clear()

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
    def _nonzero(counter: collections.Counter) -> dict:
        return dict(sorted((k, v) for k, v in counter.items() if v))

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives per device by torch's names.

        Names are torch's functional collectives: ``all_reduce``,
        ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
        ``all_to_all_single`` (and ``broadcast``, ``send_recv``).  A count is
        the number of collectives each participating device ran, whatever
        the mesh size.  tfdist's reduce-scatter (Partial -> Shard) runs as
        an all-to-all kernel that moves reduce-scatter bytes, and is counted
        as ``reduce_scatter_tensor``.
        """
        total: collections.Counter = collections.Counter()
        for launches in self._launches.values():
            total.update(launches)
        return self._nonzero(total)

    def get_comm_bytes(self) -> dict[str, float]:
        """Bytes each participating device sent, by torch's collective names.

        Read from what TF executed: the output shape, dtype and group size of
        every collective node in the per-device programs the trace shows ran,
        with ring costs (all-gather and all-to-all (k-1)/k of the output,
        all-reduce 2(k-1)/k, reduce-scatter (k-1) x the output).  Collectives
        whose program TF does not expose (XLA-compiled TPU steps) are counted
        but not measured: see :meth:`get_unmeasured_counts`.
        """
        total: collections.Counter = collections.Counter()
        for sent in self._bytes.values():
            total.update(sent)
        return self._nonzero(total)

    def get_unmeasured_counts(self) -> dict[str, int]:
        """Collectives counted from the trace whose bytes could not be read."""
        return self._nonzero(self._unmeasured)

    def get_total_counts(self) -> int:
        """All collectives per device."""
        return sum(self.get_comm_counts().values())

    def get_comm_module_counts(self) -> dict[str, dict[str, int]]:
        """Per-module collective counts (modules marked with :meth:`module`)."""
        return {m: self._nonzero(k) for m, k in self._launches.items() if self._nonzero(k)}

    def get_kernel_counts(self) -> dict[str, int]:
        """Raw executions per TF kernel type, summed over devices."""
        total: collections.Counter = collections.Counter()
        for kernels in self._kernels.values():
            total.update(kernels)
        return dict(total)

    def generate_comm_debug_tracing_table(self, noise_level: int = 0) -> str:
        """A readable table: module, collective, count and bytes per device (kernels at noise_level >= 1)."""
        rows = [("module", "collective", "per device", "bytes per device")]
        for module, counts in self.get_comm_module_counts().items():
            for name, n in counts.items():
                rows.append((module, name, str(n), f"{self._bytes[module][name]:.0f}"))
        if noise_level >= 1:
            rows.append(("", "", "", ""))
            rows.append(("TF kernel", "executions", "(all devices)", ""))
            rows += [(k, str(v), "", "") for k, v in sorted(self.get_kernel_counts().items())]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"total: {self.get_total_counts()} collective(s) per device")
        if self._unmeasured:
            lines.append(f"bytes not readable (program not exposed by TF): {self.get_unmeasured_counts()}")
        return "\n".join(lines)
