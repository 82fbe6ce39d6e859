"""glibc malloc's mmap threshold, for processes whose logical devices share one host's memory.

TF's CPU allocator takes every tensor buffer from malloc.  glibc serves a block of at
least ``mmap_threshold`` bytes with a fresh ``mmap`` and returns it to the OS on
``free``; smaller blocks come from an arena and stay with the process.  By default
the threshold is *dynamic*: freeing an mmapped block raises it to that block's size
(up to 32 MiB), so after the first step a model's multi-MiB weight, gradient and
optimizer buffers all come from arenas -- and TF DTensor runs each logical device on
a thread of its own, with an arena of its own, whose freed blocks the other devices
cannot reuse.  On 8 virtual CPUs, data-parallel W1 in ``benchmarks/compare.py``
peaked 65-105 MB higher than with a fixed 1 MiB threshold, at the same step time
(docs/performance.md).  Capping the number of arenas instead saved as much but
slowed the small-op GPT workload by 15%; a fixed threshold leaves small blocks in
their per-thread arenas and only sends the big ones to mmap.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["fix_mmap_threshold", "MMAP_THRESHOLD"]

MMAP_THRESHOLD = 1 << 20  # blocks of 1 MiB and more are mmapped, and unmapped on free
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_done = False


def _user_chose() -> bool:
    """glibc reads ``MALLOC_MMAP_THRESHOLD_`` (trailing underscore included) and the
    ``glibc.malloc.mmap_threshold`` tunable at start-up; a choice made there stands."""
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get(
        "GLIBC_TUNABLES", "")


def fix_mmap_threshold() -> int | None:
    """Fixes glibc's mmap threshold at ``MMAP_THRESHOLD`` from now on (no dynamic raise).

    Returns the threshold set, or None where it does not apply: not Linux/glibc,
    or the user chose a threshold through glibc's own environment variables.

    Example::

        tfdist._malloc.fix_mmap_threshold()   # 1048576 on Linux/glibc
    """
    global _done
    if _done or _user_chose() or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return None
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return None
    _done = True
    return MMAP_THRESHOLD
