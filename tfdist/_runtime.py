"""Devices and clients: virtual CPUs, accelerator start-up, ranks.

TF DTensor runs one program over every device of a mesh.  A *client* is one
process; it owns the *local* devices, and the mesh spans the *global* devices
of all clients.  In a single process with 8 virtual CPUs there is one client
holding 8 local devices.  The multi-client environment (client id, number of
clients, job name, jobs list) is the one TF DTensor reads: ``DTENSOR_*``.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context

from tfdist import _malloc

__all__ = [
    "init_distributed",
    "is_initialized",
    "barrier",
    "destroy",
    "virtual_cpus",
    "normalize_device_type",
    "detect_device_type",
    "local_devices",
    "num_global_devices",
    "get_rank",
    "get_world_size",
    "is_multi_client",
    "initialize_accelerators",
]

# torch spells the GPU "cuda"; TF DTensor spells device types in capitals.
_DEVICE_TYPES = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "tpu": "TPU"}

_initialized_device_type: str | None = None

# All-gathers with all-gather bytes.  TF DTensor lowers an all-gather to an
# all-reduce of a zero-padded full buffer (2x the bytes) unless this variable
# is set; tensorflow/dtensor/cc/dtensor_utils.cc reads it by exact name at
# each lowering:
#     std::getenv("LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2")  (set = on, any value)
# and tensorflow/dtensor/mlir/collectives.cc then emits CollectiveGatherV2 for
# int32/int64/f16/f32/f64 on CPU and GPU meshes (other dtypes and TPU meshes
# keep the all-reduce lowering).  Read at lowering time, so setting it here,
# before tfdist traces anything, is enough.  That lowering is wrong for a
# relayout gathering two mesh dims at once
# (docs/tf_dtensor_repros/all_gather_two_mesh_dims.py), so tfdist gathers one
# mesh dim per relayout; raw TF DTensor code in the same process that gathers
# two at once can set TFDIST_GATHER_LOWERING=reduce (read by that exact name)
# to keep TF's default lowering.
if os.environ.get("TFDIST_GATHER_LOWERING", "gather") != "reduce":
    os.environ.setdefault("LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2", "1")


_GATHER_SWITCH = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"


def all_reduce_gather_lowering() -> Callable[[], None]:
    """Turns the CollectiveGatherV2 lowering off until the returned function is called.

    CollectiveGatherV2 of an empty tensor kills the process (SIGSEGV; a relayout of a zero-size
    batch-sharded tensor, keras-hub Gemma 3's ``generate`` without images), while TF's default
    lowering (an all-reduce) handles it; a program holding empty tensors is expanded with the
    default (``tensor/_legalize.py``).  TF reads the switch at each lowering, so it holds for the
    programs expanded before the call."""
    value = os.environ.pop(_GATHER_SWITCH, None)

    def restore() -> None:
        if value is not None:
            os.environ[_GATHER_SWITCH] = value

    return restore


def gather_lowering_is_collective() -> bool:
    """Whether TF DTensor lowers all-gathers on CPU/GPU meshes to CollectiveGatherV2 (see above)."""
    return "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2" in os.environ  # TF: set = on, any value


# TF DTensor's all-reduce combine pass packs independent all-reduces into one
# buffer (dtensor_allreduce_combine_optimization.cc).  Each CollectiveReduceV2
# has a fixed cost (40 small all-reduces of one program: 16 ms against 2 ms
# packed, 8 virtual CPUs), so a train step with many replicated gradients
# pays for it.  But the pass is wrong in two kinds of program: it leaves the
# results it splits out of the buffer without a layout, so a program that
# returns one -- the backward of every tf.function under an eager tape --
# fails to compile ("missing result layout attribute for function",
# docs/tf_dtensor_repros/combined_all_reduce_returned_without_layout.py), and
# it moves a reduction past a variable write that a later read depends on
# (docs/tf_dtensor_repros/stale_read_across_calls.py).  Whether the pass is in
# the pipeline is read once, by exact name, when the DTensor device builds its
# pass pipeline (dtensor_mlir_passes.cc, DTENSOR_ENABLE_COMBINE_ALL_REDUCES_
# OPTIMIZATION); how many all-reduces one group may hold is read at every
# expansion of a function (dtensor_graph_to_mlir_pass.cc, ImportGraphToMlir:
# AllReduceCombineOptimizationGroupSize(), DTENSOR_ALLREDUCE_COMBINE_
# OPTIMIZATION_GROUP_SIZE; 0 = no limit), and a group of one is left as it is
# (CombineAllReduceOps: "A single op has nothing to combine with").  So tfdist
# puts the pass in the pipeline with groups of one -- no program is combined --
# and lifts the limit only while it expands a program it knows to be safe
# (``combined_all_reduces``: Keras train and test steps, which consume their
# gradients inside the program and read the variables they wrote through
# tfdist's read-after-write cache).  A user who set either variable keeps TF's
# behaviour as they set it.  tfdist's own values are recorded beside them
# (``_COMBINE_OWNER``), so a process started from a tfdist process -- an
# xdist worker, a launched client -- which inherits them does not take them
# for the user's choice and combine nothing.
_COMBINE_PASS = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"
_COMBINE_GROUP = "DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE"
_COMBINE_OWNER = "TFDIST_SET_DTENSOR_COMBINE"  # "<pass>,<group>" as tfdist last wrote them


def _combine_settings() -> str:
    return f"{os.environ.get(_COMBINE_PASS)},{os.environ.get(_COMBINE_GROUP)}"


def _set_combine_group(size: str) -> None:
    os.environ[_COMBINE_PASS] = "1"
    os.environ[_COMBINE_GROUP] = size
    os.environ[_COMBINE_OWNER] = _combine_settings()


_SCOPED_COMBINING = (os.environ.get(_COMBINE_OWNER) == _combine_settings()
                     or (_COMBINE_PASS not in os.environ and _COMBINE_GROUP not in os.environ))
if _SCOPED_COMBINING:
    _set_combine_group("1")


class combined_all_reduces:
    """While entered, TF DTensor combines the independent all-reduces of each function it expands
    (the pass above, with no group limit); outside, it combines none.  For programs that return no
    all-reduced value and whose reads after writes have data edges (see above).  Does nothing where
    the user chose TF's combine settings, or on TPU meshes (XLA combines there; TF's pass skips
    them).  Not thread safe: the setting is the process environment.

    Example::

        with combined_all_reduces():
            logs = train_step_program(batch)   # its first call expands it: combined
    """

    def __enter__(self) -> "combined_all_reduces":
        if _SCOPED_COMBINING:
            _set_combine_group("0")
        return self

    def __exit__(self, *exc: object) -> None:
        if _SCOPED_COMBINING:
            _set_combine_group("1")


def normalize_device_type(device_type: str) -> str:
    """Maps ``"cpu"``, ``"gpu"``/``"cuda"`` or ``"tpu"`` (any case) to TF's spelling.

    Raises:
        ValueError: for any other value.
    """
    if not isinstance(device_type, str) or device_type.lower() not in _DEVICE_TYPES:
        raise ValueError(
            "device_type must be one of 'cpu', 'gpu' (or 'cuda'), 'tpu'. "
            f"Received: device_type={device_type!r}"
        )
    return _DEVICE_TYPES[device_type.lower()]


def virtual_cpus(n: int = 8) -> list[str]:
    """Splits the host CPU into ``n`` logical devices, as a Colab user needs.

    Call it once, before anything else touches TensorFlow devices.  Calling it
    again with the same ``n`` is harmless.  With ``n > 1`` on Linux/glibc it also
    fixes malloc's mmap threshold at 1 MiB, so the devices' large buffers go back
    to the OS when freed instead of piling up in per-device-thread arenas
    (data-parallel peak memory 5-9% lower at the same speed, docs/performance.md);
    a ``MALLOC_MMAP_THRESHOLD_`` you set yourself is left alone.  And it gives each
    op the host's cores divided by the devices sharing them (``cpu_threads_per_device``):
    the devices already run their programs side by side, so an op split over every
    core only adds hand-offs (keras-hub's Gemma on 2x4 over 2 cores: steps 20-35% and
    the first epoch 15-30% shorter, docs/performance.md).  An intra-op thread count you set
    yourself (``tf.config.threading``) is left alone.

    Args:
        n: number of logical CPU devices (>= 1).

    Returns:
        The names of the logical CPU devices.

    Raises:
        ValueError: ``n`` is not a positive int.
        RuntimeError: TensorFlow already initialised its devices with a
            different number of CPUs (restart the runtime and call this first).

    Example:
        >>> import tfdist
        >>> tfdist.virtual_cpus(8)[:2]
        ['/job:localhost/replica:0/task:0/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1']
    """
    _configure_virtual_cpus(n)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def _configure_virtual_cpus(n: int) -> None:
    """Sets ``n`` logical CPUs without initialising TensorFlow's runtime.

    (Listing logical devices would initialise it, after which a multi-client
    cluster can no longer be set up.)
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int. Received: n={n!r}")
    launched = int(os.environ.get("TFDIST_VIRTUAL_CPUS", "0") or 0)
    if launched and launched != n:
        raise ValueError(
            f"virtual_cpus({n}) in a process that `tfdist run --devices-per-proc {launched}` started: "
            f"the launcher already gives each process {launched} CPUs. Drop the virtual_cpus call "
            f"or pass --devices-per-proc {n}. Received: n={n}"
        )
    if n > 1:  # several device threads share this host's malloc (see _malloc)
        _malloc.fix_mmap_threshold()
    _split_cores(n)
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is None or len(configured) != n:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * n
            )
        except RuntimeError as err:
            have = len(tf.config.list_logical_devices("CPU"))
            if have != n:
                raise RuntimeError(
                    f"virtual_cpus({n}) came too late: TensorFlow has already "
                    f"initialised its devices with {have} logical CPU(s). Call "
                    "tfdist.virtual_cpus() first, before any TensorFlow op or "
                    "device query (in Colab: Runtime > Restart, then run it in "
                    "the first cell)."
                ) from err


def _devices_on_host(n: int) -> int:
    """``n`` devices of this process times the processes ``tfdist run`` started on this host."""
    return n * max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def cpu_threads_per_device(n: int) -> int:
    """Intra-op threads for each of ``n`` CPU devices of this process: the cores this process
    may run on, shared by every device on this host (``_devices_on_host``), at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // _devices_on_host(n))


def _split_cores(n: int) -> None:
    """Each op of a CPU device gets its share of the cores, when several devices share them.

    TF runs an op over its process-wide intra-op pool (as many threads as cores), and the
    devices of a mesh run their programs at once, each op asking the whole pool: on 8
    virtual CPUs over 2 cores that is 8 programs splitting every matmul and elementwise op
    in two and waiting on each other's halves.  With the pool at cores / devices an op runs
    on its device's share and the devices fill the cores (measured in docs/performance.md).
    Set only before TF starts its runtime (after, TF keeps its pool) and only where no one
    chose a count (``get_intra_op_parallelism_threads() == 0``, TF's "pick for me")."""
    if _devices_on_host(n) == 1 or tf.config.threading.get_intra_op_parallelism_threads() != 0:
        return  # one device on the host (TF's default is right), or a count someone chose
    try:
        tf.config.threading.set_intra_op_parallelism_threads(cpu_threads_per_device(n))
    except RuntimeError:
        pass  # the runtime is up (a repeated virtual_cpus call): its pool stays


def detect_device_type() -> str:
    """The best device type present: TPU, then GPU, then CPU."""
    for kind in ("TPU", "GPU"):
        if tf.config.list_physical_devices(kind):
            return kind
    return "CPU"


def is_multi_client() -> bool:
    """True when the environment describes more than one DTensor client."""
    return int(os.environ.get("DTENSOR_NUM_CLIENTS", "1")) > 1


def get_rank() -> int:
    """This client's index (torch's rank when each process owns one device group)."""
    return int(os.environ.get("DTENSOR_CLIENT_ID", "0"))


def get_world_size() -> int:
    """Number of clients (processes) running the program."""
    return int(os.environ.get("DTENSOR_NUM_CLIENTS", "1"))


# TF DTensor sends a GPU mesh's collectives over NCCL only when this is set before
# ``initialize_accelerator_system`` (tensorflow/dtensor/python/accelerator_util.py:
# ``context.context()._collective_use_nccl_communication = config.gpu_use_nccl_communication()``;
# config.py: ``os.environ.get("DTENSOR_GPU_USE_NCCL_COMMUNICATION", "0") != "0"``), and its
# reduce-scatter lowering reads it again (mlir/utils/collective_lowering.cc): without it a GPU
# all-reduce runs TF's ring and a reduce-scatter becomes a whole all-reduce and a slice.  NCCL
# needs one logical GPU per physical one (accelerator_util.py raises otherwise), so GPUs split
# into logical devices keep the ring.  A value the user set is theirs.
_NCCL_SWITCH = "DTENSOR_GPU_USE_NCCL_COMMUNICATION"


def prefer_nccl(device_type: str, logical_gpus: int, physical_gpus: int) -> bool:
    """Sets TF DTensor's NCCL switch for a GPU mesh where NCCL can run; True if it did."""
    if device_type != "GPU" or _NCCL_SWITCH in os.environ or logical_gpus != physical_gpus:
        return False
    os.environ[_NCCL_SWITCH] = "1"  # TF's C++ reads only "0"/"1"/"true"/"false" here
    return True


def _start_accelerator_system(kind: str) -> None:
    if kind == "GPU":
        prefer_nccl(kind, len(tf.config.list_logical_devices("GPU")), len(tf.config.list_physical_devices("GPU")))
    dtensor.initialize_accelerator_system(kind)


def initialize_accelerators(device_type: str) -> None:
    """Starts the accelerator system once for ``device_type`` where TF needs it.

    GPUs (NCCL collectives), TPUs (TPU system) and any multi-client setup need
    ``dtensor.initialize_accelerator_system``; a single CPU client does not.
    """
    global _initialized_device_type
    if _initialized_device_type is not None:
        return
    if is_multi_client():
        init_distributed(device_type.lower())
        return
    if device_type in ("GPU", "TPU"):
        _start_accelerator_system(device_type)
    _initialized_device_type = device_type


def _jobs() -> list[str]:
    jobs = [j for j in os.environ.get("DTENSOR_JOBS", "").split(",") if j]
    if len(jobs) != get_world_size():
        raise RuntimeError(
            f"DTENSOR_JOBS lists {len(jobs)} clients but DTENSOR_NUM_CLIENTS is "
            f"{get_world_size()}; start the program with `tfdist run`, which sets both."
        )
    return jobs


def _rendezvous(timeout: float) -> None:
    """Every client checks in with client 0 before TF's multi-client start-up, with a timeout.

    TF's ``initialize_accelerator_system`` blocks in C++ (holding the GIL)
    until every client has joined, with no timeout: a client whose peers never
    start would wait forever.  So first, on client 0's own port (before TF's
    server takes it over): client 0 listens, each other client connects and
    sends its rank, and client 0 answers ``go`` once all are there.  Whoever
    waits past ``timeout`` raises ``TimeoutError`` naming what is missing.
    """
    host, port = _jobs()[0].rsplit(":", 1)
    deadline = time.monotonic() + timeout
    if get_rank() == 0:
        _host_rendezvous(int(port), deadline, timeout)
    else:
        _join_rendezvous(host, int(port), deadline, timeout)


def _host_rendezvous(port: int, deadline: float, timeout: float) -> None:
    world = get_world_size()
    peers: dict[int, socket.socket] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TF's server binds it next
        server.bind(("", port))
        server.listen(world)
        server.settimeout(0.2)
        try:
            while len(peers) < world - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, world)) - set(peers))
                    raise TimeoutError(
                        f"client 0 waited {timeout:g} s for the other clients; ranks {missing} never "
                        f"joined (of {world}). Did they start (tfdist run --nproc-per-node/--nnodes), "
                        "and can they reach this host's --master-addr/--master-port?"
                    )
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(5.0)
                try:
                    rank = int(conn.recv(16).decode().strip() or -1)
                except (OSError, ValueError):
                    conn.close()
                    continue
                if 0 < rank < world:
                    peers[rank] = conn
                else:
                    conn.close()
            for conn in peers.values():
                conn.sendall(b"go\n")
            for conn in peers.values():  # the peers close first: no TIME_WAIT on this port
                try:
                    conn.recv(16)
                except OSError:
                    pass
        finally:
            for conn in peers.values():
                conn.close()


def _join_rendezvous(host: str, port: int, deadline: float, timeout: float) -> None:
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0) as conn:
                conn.sendall(f"{get_rank()}\n".encode())
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                if conn.recv(16).startswith(b"go"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"client {get_rank()} could not join client 0 at {host}:{port} within {timeout:g} s. "
                "Is client 0 running (and are all other clients started), and are "
                "--master-addr/--master-port (DTENSOR_JOBS) right and reachable?"
            )
        time.sleep(0.2)


def init_distributed(device_type: str | None = None, *, timeout: float = 300.0) -> None:
    """Joins this process to the multi-client DTensor program (torch's init_process_group).

    Reads the environment ``tfdist run`` sets (``DTENSOR_CLIENT_ID``,
    ``DTENSOR_NUM_CLIENTS``, ``DTENSOR_JOB_NAME``, ``DTENSOR_JOBS`` and
    ``TFDIST_VIRTUAL_CPUS``).  TPU: initialises the TPU system; GPU: one
    process per GPU, NCCL collectives.  ``init_device_mesh`` calls it when
    the environment says multi-client.  Idempotent.

    Raises:
        TimeoutError: within ``timeout`` seconds, client 0 did not see every
            other client check in (the message names the missing ranks), or
            another client could not reach client 0.
    """
    global _initialized_device_type
    if _initialized_device_type is not None:
        return
    cpus = int(os.environ.get("TFDIST_VIRTUAL_CPUS", "0") or 0)
    if cpus:
        _configure_virtual_cpus(cpus)
    kind = normalize_device_type(device_type) if device_type else detect_device_type()
    if is_multi_client():
        _rendezvous(timeout)
    if is_multi_client() or kind in ("GPU", "TPU"):
        _start_accelerator_system(kind)
    _initialized_device_type = kind


def is_initialized() -> bool:
    """True once devices (and, multi-client, the cluster) are set up."""
    return _initialized_device_type is not None


_barriers = 0  # barriers this client has passed
_BARRIER_TIMEOUT_MS = 3_600_000  # an hour: a client that never comes fails the barrier instead of hanging it


def barrier() -> None:
    """Blocks until every client reaches it, after this client's pending device work.

    Across clients it meets at a barrier of TF's coordination service, not a TF DTensor
    collective: once pipeline stages on sub-meshes of different clients have run, the clients have
    lowered different programs and TF DTensor's per-process collective keys no longer agree for a new
    collective over all devices (docs/design.md, "A stage whose sub-mesh spans clients").
    """
    kind = _initialized_device_type or detect_device_type()
    n = num_global_devices(kind)
    if n == 1:
        return
    if is_multi_client():
        global _barriers
        context.async_wait()  # this client's queued ops finish first, as a collective would wait for them
        _barriers += 1  # every client passes its barriers in one order: the n-th one has one id everywhere
        context.context().wait_at_barrier(f"tfdist/barrier/{_barriers}", timeout_in_ms=_BARRIER_TIMEOUT_MS)
        return
    mesh = dtensor.create_mesh([("all", n)], device_type=kind)
    ones = dtensor.call_with_layout(tf.ones, dtensor.Layout(["all"], mesh), shape=(n,))
    total = dtensor.relayout(tf.reduce_sum(ones, keepdims=True), dtensor.Layout.replicated(mesh, 1))
    dtensor.unpack(total)[0].numpy()


def destroy() -> None:
    """Leaves the program (torch's ``destroy_process_group``).

    Single client on GPU/TPU: shuts the accelerator system down.  Multi-client:
    waits for every client (a barrier) and for this client's pending work;
    TF cannot shut a multi-client system down ("Shutting down accelerator
    system under multi-client mode is not supported", raised by
    ``dtensor.shutdown_accelerator_system`` whenever ``config.is_local_mode()``
    is false), so its servers stop when the process exits.  Idempotent.
    """
    global _initialized_device_type
    if _initialized_device_type is None:
        return
    if is_multi_client():
        barrier()
        context.async_wait()
    elif _initialized_device_type in ("GPU", "TPU"):
        dtensor.shutdown_accelerator_system()
    _initialized_device_type = None


_BACKENDS = {"gloo": "cpu", "nccl": "gpu", "xla": "tpu", None: None}


def init_process_group(
    backend: str | None = None, init_method: str | None = None, timeout: Any = None,
    world_size: int = -1, rank: int = -1, **kwargs: Any,
) -> None:
    """torch's ``init_process_group``: joins the multi-client program (``init_distributed``).

    ``backend`` names the device type (``"gloo"``: CPU, ``"nccl"``: GPU,
    ``"xla"``: TPU; or ``"cpu"``/``"gpu"``/``"tpu"``); ``timeout`` (seconds
    or a ``timedelta``) bounds the wait for client 0.  ``world_size`` and
    ``rank``, when given, must match what ``tfdist run`` set up.
    ``init_method`` and torch's other arguments describe a rendezvous that
    ``tfdist run`` already did, and are accepted and ignored.

    Example::

        tfdist.init_process_group("gloo")
        ...
        tfdist.destroy_process_group()
    """
    del init_method, kwargs
    name = backend.lower() if isinstance(backend, str) else backend
    if name not in _BACKENDS and name not in ("cpu", "gpu", "tpu"):
        raise ValueError(
            f"init_process_group: backend must be one of 'gloo', 'nccl', 'xla', 'cpu', 'gpu', 'tpu' "
            f"or None. Received: backend={backend!r}"
        )
    for arg, given, actual in (("world_size", world_size, get_world_size()), ("rank", rank, get_rank())):
        if given not in (-1, None) and given != actual:
            raise ValueError(
                f"init_process_group: {arg}={given} but this process is {arg} {actual} of the job "
                "`tfdist run` started; omit it or pass the launcher's value."
            )
    seconds = 300.0 if timeout is None else float(getattr(timeout, "total_seconds", lambda: timeout)())
    init_distributed(_BACKENDS.get(name, name), timeout=seconds)


def destroy_process_group(group: Any = None) -> None:
    """torch's ``destroy_process_group``: :func:`destroy` (tfdist has one group, the job)."""
    del group
    destroy()


def local_devices(device_type: str) -> list[str]:
    """Names of this client's logical devices of ``device_type``."""
    return [d.name for d in tf.config.list_logical_devices(device_type)]


def num_global_devices(device_type: str) -> int:
    """Devices of ``device_type`` over all clients."""
    if is_multi_client():
        return dtensor.num_global_devices(device_type)
    return len(local_devices(device_type))


def apply_launcher_devices() -> None:
    """A single process that ``tfdist run --devices-per-proc K`` started gets its K CPUs at import
    (a multi-client one gets them in ``init_distributed``, before the cluster starts)."""
    cpus = int(os.environ.get("TFDIST_VIRTUAL_CPUS", "0") or 0)
    if cpus and not is_multi_client():
        _configure_virtual_cpus(cpus)

