"""Free local ports for jobs of several client processes started by tests."""

from __future__ import annotations

import os
import pathlib
import random
import socket


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux: 32768 by default)."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_base_port(n: int) -> int:
    """A port p such that p .. p+n-1 are free on this machine, for a job launched right after.

    Drawn below the kernel's ephemeral range: a port there may be handed to any outgoing
    connection (another test's gRPC channel) between this check and the job's bind -- the "port
    is already in use" of a loaded CI run.  Each pytest-xdist worker draws from a band of its own,
    so two workers never hand out the same port either."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    band = (_ephemeral_low() - 1 - 10000) // workers
    low = 10000 + worker * band
    for _ in range(200):
        base = random.randint(low, low + band - n - 1)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")
