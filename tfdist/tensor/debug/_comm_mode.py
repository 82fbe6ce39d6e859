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
import json
import shutil
import tempfile
from typing import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from tfdist.tensor import _comm_events
from tfdist.tensor.debug._comm_modules import GLOBAL, ModuleTree
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


_FUNCTION_COLLECTIVES: dict[str, list[tuple[tuple[str, ...], bool, str, float | None]]] = {}


def _function_nodes_by_scope(name: str) -> list[tuple[tuple[str, ...], bool, str, float | None]]:
    """(name scope, in the backward, torch name, bytes sent per device) of each collective node in one
    call of function ``name``.

    Read from the SPMD-expanded function TF executed (kept in the eager
    context): each collective node's ``_output_shapes``, dtype and constant
    group size, and the functions it calls.  The scope is the node's name
    without its last part; ``gradient_tape/`` (Keras' and ``tf.GradientTape``'s
    backward) or a ``..._grad`` segment marks the backward.  Names are the
    kernels' (tfdist's reduce-scatter is an all-to-all here); renaming happens
    later (``CommDebugMode._relabel`` and ``_module_view``).  Cached: a
    function's body never changes under its name.
    """
    if name not in _FUNCTION_COLLECTIVES:
        found = []
        for by_name, node in function_nodes([name]):
            logical = _logical_name(node.name, node.op) if node.op in _WIRE else None
            if logical:
                segments = tuple(node.name.split("/")[:-1])
                backward = segments[:1] == ("gradient_tape",) or any(s.endswith("_grad") for s in segments)
                nbytes = _node_output_bytes(node)
                k = _constant_input(by_name, node.input[1])
                sent = _WIRE[node.op](nbytes, k) if nbytes is not None and k is not None else None
                found.append((segments[1:] if segments[:1] == ("gradient_tape",) else segments,
                              backward, logical, sent))
        _FUNCTION_COLLECTIVES[name] = found
    return _FUNCTION_COLLECTIVES[name]


def _function_collectives(name: str) -> tuple[collections.Counter, collections.Counter]:
    """(bytes sent per device, collective nodes whose bytes are known) by torch name in one call of
    function ``name``, summed from :func:`_function_nodes_by_scope`."""
    sent: collections.Counter = collections.Counter()
    nodes: collections.Counter = collections.Counter()
    for _, _, logical, n in _function_nodes_by_scope(name):
        if n is not None:
            sent[logical] += n
            nodes[logical] += 1
    return sent, nodes


def _scoped_collectives(executed: str) -> list[tuple[str, str, float, int, tuple[str, ...], bool]]:
    """tfdist's marked collectives in one call of the executed function ``executed``.

    DTensor names the SPMD-expanded function ``<traced name>__func_<hash>``;
    the traced function (kept beside it) still carries tfdist's name scopes
    (``_comm_events.graph_scope``), while the expanded one may not.
    Each: (logical, kernel, output bytes, group size, the name scope around the mark, backward?).
    """
    traced = executed.split("__func_")[0]
    if traced == executed:
        return []
    found: list[tuple[str, str, float, int, tuple[str, ...], bool]] = []
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
                before = tuple(segments[:i])
                in_backward = before[:1] == ("gradient_tape",) or any(b.endswith("_grad") for b in before)
                found.append((*_comm_events.scoped_collective(segment),
                              before[1:] if before[:1] == ("gradient_tape",) else before, in_backward))
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
        # the module view: (marked module, name scope, backward?, torch name) -> collectives, bytes
        self._scoped: collections.Counter = collections.Counter()
        self._scoped_bytes: collections.Counter = collections.Counter()
        # marked collectives found in traced functions, with their scope: see _module_view
        self._renamed_scoped: list[tuple[str, tuple[str, ...], bool, str, str, float, int, int]] = []
        self._module = GLOBAL
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
            for logical, kernel, out, k, scope, backward in _scoped_collectives(function):
                self._renamed.append((module, logical, kernel, out, k, calls))
                self._renamed_scoped.append((module, scope, backward, logical, kernel, out, k, calls))
            for scope, backward, logical, sent in _function_nodes_by_scope(function):
                self._scoped[(module, scope, backward, logical)] += calls
                self._scoped_bytes[(module, scope, backward, logical)] += calls * (sent or 0.0)
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
        self._scoped.clear()
        self._scoped_bytes.clear()
        self._renamed_scoped.clear()
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

    def _module_view(self) -> tuple[ModuleTree, dict, dict]:
        """The module tree, and per module {"forward"/"backward": Counter} of collectives and bytes.

        A collective marked with :meth:`module` belongs to that module (and ``Global``); the others to
        the layers their name scopes walk through (``_comm_modules``).  Parents include their children.
        """
        tree = ModuleTree({scope for (marked, scope, _, _) in self._scoped if marked == GLOBAL})
        counts: dict = collections.defaultdict(lambda: {"forward": collections.Counter(),
                                                        "backward": collections.Counter()})
        sent: dict = collections.defaultdict(lambda: {"forward": collections.Counter(),
                                                      "backward": collections.Counter()})
        scoped, scoped_bytes = collections.Counter(self._scoped), collections.Counter(self._scoped_bytes)
        # tfdist's reduce-scatter runs as an all-to-all that the expansion names inside its mark or leaves
        # bare: the mark in the traced function gives its name, scope and pass; that many kernels move
        # there, the ones inside a mark first, then bare ones (outside every layer)
        for marked, scope, backward, logical, kernel, out, k, times in self._renamed_scoped:
            plain = classify_kernel(kernel)
            inside = [key for key in scoped if key[0] == marked and key[3] == plain
                      and any(_comm_events.scoped_collective(s) for s in key[1])]
            bare = [key for key in scoped if key[0] == marked and key[3] == plain and key not in inside
                    and len(tree.resolve(key[1])) == 1]
            for key in inside + bare:
                n = min(times, scoped[key])
                if n <= 0:
                    continue
                wire = _WIRE[kernel](out, k) * n if out is not None else 0.0
                scoped[key] -= n
                scoped_bytes[key] -= min(wire, scoped_bytes[key])
                scoped[(marked, scope, backward, logical)] += n
                scoped_bytes[(marked, scope, backward, logical)] += wire
                times -= n
                if times <= 0:
                    break
        for key, n in scoped.items():
            if n <= 0:
                continue
            marked, scope, backward, logical = key
            path = tree.resolve(scope) if marked == GLOBAL else [GLOBAL, tree.add_marked(marked)]
            direction = "backward" if backward else "forward"
            for fqn in path:
                counts[fqn][direction][logical] += n
                sent[fqn][direction][logical] += scoped_bytes[key]
        return tree, counts, sent

    def get_comm_module_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """Collectives per module and pass, torch's ``comm_module_counts``:
        ``{"Global": {"forward": {...}, "backward": {...}}, "GPT.blocks.0.mlp": {...}, ...}``.

        Modules are the Keras layers whose calls needed the collectives (read from the executed
        programs' name scopes, ``Global`` for the rest) or the names given to :meth:`module`; a
        module's counts include its children's, ``Global``'s everything.  Counts are per device.
        The pass is read from the scope too (``gradient_tape/``): a collective outside every layer
        call and outside the tape's backward -- the loss, the gradient reduce-scatters FSDP runs
        after the tape, an eager move -- counts in ``Global``'s forward.

        Example::

            with CommDebugMode() as comm:
                model.train_function(iterator)
            comm.get_comm_module_counts()["GPT.blocks.0.mlp.down"]
            # {'forward': {'all_reduce': 1}, 'backward': {}}
        """
        _, counts, _ = self._module_view()
        return {fqn: {d: self._nonzero(c[d]) for d in ("forward", "backward")}
                for fqn, c in counts.items() if any(c[d] for d in c)}

    def get_parameter_info(self) -> dict[str, dict[str, tuple]]:
        """Per module whose collectives ran, its parameters on a mesh and their placements (torch's
        ``module_parameters_dict``): ``{"GPT.blocks.0.mlp.up": {"kernel": (Shard(dim=0), Shard(dim=1))}}``."""
        tree, counts, _ = self._module_view()
        return {fqn: dict(tree.modules[fqn].parameters) for fqn in tree.called(set(counts))
                if tree.modules[fqn].parameters}

    def get_sharding_info(self) -> dict[str, tuple]:
        """Each parameter's placements by ``"<module fqn>.<name>"`` (torch's ``sharding_dict``)."""
        return {f"{fqn}.{name}": placements for fqn, params in self.get_parameter_info().items()
                for name, placements in params.items()}

    def get_kernel_counts(self) -> dict[str, int]:
        """Raw executions per TF kernel type, summed over devices."""
        total: collections.Counter = collections.Counter()
        for kernels in self._kernels.values():
            total.update(kernels)
        return dict(total)

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """torch's module table: each module (indented by depth), its collectives per device in the
        FORWARD PASS and BACKWARD PASS with the bytes each device sent.

        ``noise_level`` >= 1 adds each module's type and parameters with their placements (torch),
        >= 2 the TF kernels that ran (tfdist's counterpart of torch's operation lists, which a
        compiled TF program does not expose one by one).
        """
        tree, counts, sent = self._module_view()
        lines = []
        for fqn in tree.called(set(counts)):
            info = tree.modules[fqn]
            indent = "  " * (2 * info.depth)
            lines.append(f"{indent}{fqn}")
            if noise_level >= 1 and info.module_type:
                lines.append(f"{indent}*module type: {info.module_type}")
                if info.parameters:
                    lines.append(f"{indent}*Parameter List")
                    lines += [f"{indent} *{name}: {placements}" for name, placements in info.parameters.items()]
            for direction, title in (("forward", "FORWARD PASS"), ("backward", "BACKWARD PASS")):
                done = self._nonzero(counts[fqn][direction]) if fqn in counts else {}
                if done:
                    lines.append(f"{indent}  {title}")
                    lines += [f"{indent}    *{name}: {n} ({sent[fqn][direction][name]:,.0f} bytes per device)"
                              for name, n in done.items()]
        if noise_level >= 2:
            lines += ["", "TF kernel executions (all devices):"]
            lines += [f"  {k}: {v}" for k, v in sorted(self.get_kernel_counts().items())]
        lines.append(f"total: {self.get_total_counts()} collective(s) per device")
        if self._unmeasured:
            lines.append(f"bytes not readable (program not exposed by TF): {self.get_unmeasured_counts()}")
        return "\n".join(lines)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt", noise_level: int = 3) -> None:
        """Writes :meth:`generate_comm_debug_tracing_table` to ``file_name`` (torch's)."""
        with open(file_name, "w") as f:
            f.write(self.generate_comm_debug_tracing_table(noise_level) + "\n")

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """Writes the module tree as torch's JSON (``fqn``, ``module_type``, ``parameters``,
        ``children``, ``collectives_forward``/``_backward`` as ``[name, count]`` pairs), plus
        ``bytes_forward``/``bytes_backward`` per collective.  ``operations_*`` stay empty: a compiled TF
        program runs its ops inside one call (see :meth:`generate_comm_debug_tracing_table`).
        ``noise_level`` >= 1 includes module types and parameters, as in torch.
        """
        tree, counts, sent = self._module_view()
        shown = set(tree.called(set(counts)))

        def node(fqn: str) -> dict:
            info, c = tree.modules[fqn], counts.get(fqn, {"forward": {}, "backward": {}})
            return {
                "fqn": fqn,
                "module_type": info.module_type if noise_level >= 1 else "",
                "parameters": [[n, str(p)] for n, p in info.parameters.items()] if noise_level >= 1 else [],
                "children": [node(child) for child in info.children if child in shown],
                "collectives_forward": [[k, v] for k, v in self._nonzero(c["forward"]).items()],
                "collectives_backward": [[k, v] for k, v in self._nonzero(c["backward"]).items()],
                "bytes_forward": {k: sent[fqn]["forward"][k] for k in self._nonzero(c["forward"])},
                "bytes_backward": {k: sent[fqn]["backward"][k] for k in self._nonzero(c["backward"])},
                "operations_forward": [], "operations_backward": [], "operations_checkpointing": [],
            }

        with open(file_name, "w") as f:
            json.dump(node(GLOBAL), f, indent=4)
