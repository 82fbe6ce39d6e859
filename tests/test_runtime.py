"""Process-level behaviour, checked in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)


def test_import_tfdist_adds_nothing_beyond_tensorflow():
    # TensorFlow 2.21 itself imports keras (for tf.keras); tfdist must add no
    # heavy module of its own: no tf_keras, no TensorFlow Probability.
    out = _run(
        "import sys, tensorflow\n"
        "before = set(sys.modules)\n"
        "import tfdist, tfdist.tensor, tfdist.tensor.debug\n"
        "added = set(sys.modules) - before\n"
        "print(sorted(m for m in added if m.split('.')[0] != 'tfdist'))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_virtual_cpus_after_init_is_a_clear_error():
    out = _run(
        "import tensorflow as tf, tfdist\n"
        "tf.constant(1.0) + 1\n"
        "try:\n"
        "    tfdist.virtual_cpus(4)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "ERR virtual_cpus(4) came too late" in out.stdout
    assert "Call tfdist.virtual_cpus() first" in out.stdout


def test_import_enables_the_all_gather_lowering_unless_opted_out():
    """tfdist sets TF's switch (read by exact name) for CollectiveGatherV2, unless asked not to."""
    import os
    import subprocess
    import sys

    code = "import os, tfdist; print(os.environ.get('LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2'))"
    env = {k: v for k, v in os.environ.items() if k != "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    off = subprocess.run([sys.executable, "-c", code], env={**env, "TFDIST_GATHER_LOWERING": "reduce"},
                         capture_output=True, text=True, timeout=300)
    assert on.stdout.split()[-1] == "1", on.stderr[-500:]
    assert off.stdout.split()[-1] == "None", off.stderr[-500:]


# 16 threads that each hold 50 malloc'd blocks of 64 KiB at once (below glibc's mmap threshold,
# so they come from an arena), then the arenas glibc made, counted in malloc_info's XML.
_ARENAS = """
import ctypes, os, sys, tempfile, threading
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # at most 2 usable cores, on any machine
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
together = threading.Barrier(16)
def work():
    blocks = [libc.malloc(64 * 1024) for _ in range(50)]
    together.wait()
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
path = tempfile.mktemp()
f = libc.fopen(path.encode(), b"w"); libc.malloc_info(0, f); libc.fclose(f)
print("ARENAS", open(path).read().count("<heap nr="), "CORES", len(os.sched_getaffinity(0)))
"""


def _arenas(setup: str, **env: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _ARENAS.format(setup=setup)], capture_output=True, text=True,
                         env={**ENV, **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split("ARENAS", 1)[1].split()
    return int(words[0]), int(words[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc arenas")
def test_virtual_cpus_keeps_one_malloc_arena_per_core():
    """TF DTensor runs a thread per device; glibc's default (8 arenas per online core) gives each
    its own.  Reference: the same threads in a process without tfdist, and malloc_info's count."""
    plain, cores = _arenas("import tensorflow")
    limited, _ = _arenas("import tfdist; tfdist.virtual_cpus(8)")
    assert limited <= cores < plain  # the control shows the count can exceed the cores
    chosen, _ = _arenas("import tfdist; tfdist.virtual_cpus(8); print(tfdist._malloc.limit_arenas())",
                        MALLOC_ARENA_MAX="12")
    assert chosen > cores  # the user's MALLOC_ARENA_MAX stands
