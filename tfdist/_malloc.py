"""glibc's malloc arenas, for processes whose logical devices share one host's cores.

TF DTensor runs every device of a mesh on a thread of its own, and glibc gives each thread
that allocates an arena of its own -- up to 8 per core by default (``NARENAS_FROM_NCORES``
on 64-bit).  With 8 virtual CPUs on a 2-core host the freed memory of those arenas is not
returned and not shared: data-parallel W1 in ``benchmarks/compare.py`` peaked 50-70 MB
higher than with one arena per core, for the same step time (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["limit_arenas"]

_M_ARENA_MAX = -8  # glibc's malloc.h
_done = False


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def limit_arenas() -> int | None:
    """At most one malloc arena per usable core, from now on.  Returns the limit set, or None
    where it does not apply: not glibc, or ``MALLOC_ARENA_MAX`` already chosen by the user
    (glibc reads that variable itself at start-up, and tfdist leaves it alone).

    Example::

        tfdist._malloc.limit_arenas()   # 2 on a 2-core host
    """
    global _done
    if _done or "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return None
    limit = max(1, _usable_cores())
    if mallopt(_M_ARENA_MAX, limit) != 1:
        return None
    _done = True
    return limit
