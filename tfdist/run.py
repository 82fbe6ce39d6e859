"""``tfdist run``: start one client per process, torchrun-style, for multi-client DTensor.

Every process gets the multi-client environment TF DTensor reads
(``DTENSOR_CLIENT_ID``, ``DTENSOR_NUM_CLIENTS``, ``DTENSOR_JOB_NAME``,
``DTENSOR_JOBS``) plus torch's names (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).  Client ``r`` serves on
port ``master_port + r`` of its node, client 0 being the coordinator.  As torchrun
sets ``OMP_NUM_THREADS``, a CPU job on x86-64 Linux gets ``TF_ENABLE_ONEDNN_OPTS=1``
unless the variable is set: TF's oneDNN kernels, which TF itself turns on only on
CPUs with AVX512_VNNI or AMX (``tfdist/_cpu_kernels.py``).

The launcher prefixes each output line with ``[rank r]``, forwards SIGINT and
SIGTERM to its children, and when a process fails it stops the others and
exits with that process's code, naming it.  Bad arguments, a missing script
or a port in use are reported before anything starts.

Example (4 local clients with 2 virtual CPUs each)::

    tfdist run --nproc-per-node 4 --devices-per-proc 2 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from tfdist._cpu_kernels import onednn_default

__all__ = ["main", "build_parser", "client_environments"]

_GRACE_SECONDS = 5.0


def build_parser(prog: str = "tfdist run") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start a multi-client tfdist program, as torchrun does: one process per client.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: tfdist run --nproc-per-node 2 --devices-per-proc 4 train.py --epochs 3",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes (clients) on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (the coordinator)")
    parser.add_argument("--master-port", type=int, default=29500, help="first port; client r uses port + r")
    parser.add_argument(
        "--node-addrs", default=None,
        help="comma-separated address of every node (TF needs each client's address); "
             "default: --master-addr for a single node",
    )
    parser.add_argument("--devices-per-proc", type=int, default=0,
                        help="virtual CPUs per process (local testing); 0 keeps the real devices")
    parser.add_argument("--device-type", choices=("cpu", "gpu", "tpu"), default="cpu",
                        help="gpu: each process sees one GPU (CUDA_VISIBLE_DEVICES=local rank)")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds the whole job may run; then every process is stopped (exit 124). 0: no limit")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's own log lines (python -m tfdist.run is quiet by default)")
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Validates arguments; returns every node's address."""
    for name in ("nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.devices_per_proc < 0:
        parser.error(f"--devices-per-proc must be >= 0, got {args.devices_per_proc}")
    if args.timeout < 0:
        parser.error(f"--timeout must be >= 0 seconds, got {args.timeout}")
    world = args.nproc_per_node * args.nnodes
    if not 1024 <= args.master_port <= 65535 - world:
        parser.error(f"--master-port must leave room for {world} ports below 65536, got {args.master_port}")
    nodes = args.node_addrs.split(",") if args.node_addrs else [args.master_addr] * args.nnodes
    if len(nodes) != args.nnodes:
        parser.error(f"--node-addrs lists {len(nodes)} nodes but --nnodes is {args.nnodes}")
    if nodes[0] != args.master_addr and args.node_addrs:
        parser.error(f"--node-addrs must start with --master-addr ({args.master_addr}), got {nodes[0]}")
    if not args.module and not os.path.isfile(args.script):
        parser.error(f"script not found: {args.script}")
    for local_rank in range(args.nproc_per_node):
        port = args.master_port + args.node_rank * args.nproc_per_node + local_rank
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # as a server binds: sockets of a finished run left in TIME_WAIT do not block the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("", port))
            except OSError:
                parser.error(f"port {port} (for rank {args.node_rank * args.nproc_per_node + local_rank}) "
                             "is already in use; choose another --master-port")
    return nodes


def client_environments(args: argparse.Namespace, nodes: Sequence[str]) -> list[dict[str, str]]:
    """The environment of each local process."""
    world = args.nproc_per_node * args.nnodes
    jobs = ",".join(
        f"{nodes[rank // args.nproc_per_node]}:{args.master_port + rank}" for rank in range(world)
    )
    envs = []
    for local_rank in range(args.nproc_per_node):
        rank = args.node_rank * args.nproc_per_node + local_rank
        env = dict(os.environ)
        env.update({
            "DTENSOR_CLIENT_ID": str(rank), "DTENSOR_NUM_CLIENTS": str(world),
            "DTENSOR_JOB_NAME": "worker", "DTENSOR_JOBS": jobs,
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
            "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
            "PYTHONUNBUFFERED": "1",
        })
        if world == 1:
            # one client is TF DTensor's local mode: its devices are /job:localhost, and a
            # DTENSOR_JOB_NAME would make meshes name devices that do not exist
            for key in ("DTENSOR_CLIENT_ID", "DTENSOR_NUM_CLIENTS", "DTENSOR_JOB_NAME", "DTENSOR_JOBS"):
                env.pop(key)
        if args.devices_per_proc:
            env["TFDIST_VIRTUAL_CPUS"] = str(args.devices_per_proc)
        env.update(onednn_default(env, args.device_type))
        if args.device_type == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
        envs.append(env)
    return envs


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGKILL when the launcher dies (Linux),
    so a killed launcher leaves no orphans."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: no parent-death signal to ask for
        pass


def _pump(stream, rank: int, out) -> None:
    for line in iter(stream.readline, ""):
        # a last line without its newline would run into the next rank's output
        out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
        out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    for p in procs:
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
            p.wait()


def main(argv: Sequence[str] | None = None, prog: str = "tfdist run") -> int:
    """Runs the launcher; returns the exit status (0 when every process succeeded)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    nodes = _check(args, parser)
    target = ["-m", args.script] if args.module else [args.script]
    command = [sys.executable, "-u", *target, *args.script_args]
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []
    reached = [0]  # how many clients the last forwarded signal reached

    def forward(signum, frame):
        received.append(signum)
        reached[0] = len(procs)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # The handlers go in before the first client starts: a signal that arrives while the
    # clients start reaches every client already started, and no further client starts.
    # Before, one that arrived in that window killed the launcher and left the clients running.
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    first_rank = args.node_rank * args.nproc_per_node
    try:
        for i, env in enumerate(client_environments(args, nodes)):
            if received:
                break
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, bufsize=1, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            procs.append(proc)
            if received and reached[0] < len(procs):  # it started while the signal was handled
                proc.send_signal(received[-1])
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, first_rank + i, out), daemon=True)
                t.start()
                pumps.append(t)
        return _supervise(args, procs, received, first_rank)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _stop(procs)
        for t in pumps:
            t.join(timeout=2)


def _supervise(args, procs: list[subprocess.Popen], received: list[int], first_rank: int) -> int:
    """Waits for the clients; the exit status of the job."""
    status = 0
    deadline = time.monotonic() + args.timeout if args.timeout else None
    while True:
        if deadline is not None and time.monotonic() > deadline:
            sys.stderr.write(f"tfdist run: the job ran past --timeout {args.timeout:g}s; stopping every process\n")
            status = 124  # timeout(1)'s status
            break
        codes = [p.poll() for p in procs]
        failed = [(first_rank + i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            if received:
                # the clients ended after the launcher forwarded a signal: not a failure of theirs,
                # whatever their code (-SIGINT, or 1 from a KeyboardInterrupt -- also raised while
                # Python itself starts, where site's import fails on it)
                sys.stderr.write(f"tfdist run: interrupted by {signal.Signals(received[0]).name}; stopping\n")
                code = -received[0]
            else:
                sys.stderr.write(
                    f"tfdist run: rank {rank} exited with code {code}; stopping the other "
                    f"{sum(c is None for c in codes)} process(es)\n"
                )
            _stop(procs)
            status = code if code > 0 else 128 - code  # -9 (killed) -> 137
            break
        if all(c == 0 for c in codes):
            break
        time.sleep(0.1)
    if received and status == 0:
        status = 128 + received[0]
    return status


if __name__ == "__main__":  # python -m tfdist.run
    sys.exit(main(prog="python -m tfdist.run"))
