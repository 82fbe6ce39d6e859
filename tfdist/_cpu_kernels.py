"""TF's oneDNN CPU kernels for the processes ``tfdist run`` starts.

On Linux, TF turns oneDNN on by default only on CPUs with AVX512_VNNI, AVX512_BF16,
AVX_VNNI or AMX (``DefaultOneDnnPolicy`` in ``tensorflow/core/util/util.cc``). It reads
``TF_ENABLE_ONEDNN_OPTS`` once, when TF loads, so no code in a process that has
imported TF can change the choice. On a 2-core AVX2 AMD EPYC, where TF leaves oneDNN
off, turning it on made these steps faster (docs/performance.md):
  - the GPT of benchmarks/compare.py on a 2x4 mesh: 83 -> 68 ms (one device 72 -> 47 ms);
  - keras-hub's Gemma on a 2x4 mesh: 322 -> 279 ms (one device 348 -> 199 ms).
On CPUs with those features TF turns it on by default anyway.

So, as torchrun sets ``OMP_NUM_THREADS`` for the processes it starts, tfdist sets
``TF_ENABLE_ONEDNN_OPTS=1`` for the CPU processes it starts on x86-64 Linux. A value the
user set, ``0`` included, is kept. GPU and TPU jobs, and other platforms, get TF's
default (on aarch64, TF's oneDNN build is experimental off Neoverse V1).
"""

from __future__ import annotations

import platform
from typing import Mapping

ONEDNN = "TF_ENABLE_ONEDNN_OPTS"


def is_x86_linux() -> bool:
    """Whether this host is x86-64 Linux, where tfdist run turns oneDNN on for CPU jobs."""
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


def onednn_default(env: Mapping[str, str], device_type: str = "cpu") -> dict[str, str]:
    """What to add to the environment ``env`` of a process tfdist starts, on
    ``device_type`` devices: ``{"TF_ENABLE_ONEDNN_OPTS": "1"}`` for a CPU job on x86-64
    Linux where the variable is unset, else nothing.

    Example:
        >>> env = dict(os.environ); env.update(onednn_default(env, "cpu"))
    """
    if ONEDNN in env or device_type.lower() != "cpu" or not is_x86_linux():
        return {}
    return {ONEDNN: "1"}
