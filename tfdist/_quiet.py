"""The ``tfdist`` command starts quietly; the library leaves the user's logging alone.

TensorFlow logs at import time -- before any of tfdist's code could set
``TF_CPP_MIN_LOG_LEVEL`` from inside the command -- and some of those lines
(absl's "before InitializeLog" messages, the CUDA probe) ignore the level.
So when, and only when, the running program is the ``tfdist`` command
(the console script, ``python -m tfdist.cli``, or the launcher as
``python -m tfdist.run``) without ``--verbose``,
``import tfdist`` sets ``TF_CPP_MIN_LOG_LEVEL=3`` (unless the user set it)
and discards the C++ side's stderr while TensorFlow loads.  Python errors
during the import are still raised and printed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

__all__ = ["is_quiet_command", "quiet_import"]


def is_quiet_command(argv: list[str] | None = None) -> bool:
    """Whether this process is the ``tfdist`` command run without ``--verbose``."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    if "--verbose" in argv:
        return False
    as_script = bool(sys.argv) and os.path.basename(sys.argv[0]) == "tfdist"
    as_module = any(a == "-m" and b in ("tfdist.cli", "tfdist.run") for a, b in zip(argv, argv[1:]))
    return as_script or as_module


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Inside, file descriptor 2 goes to /dev/null (for the tfdist command only)."""
    if not is_quiet_command():
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
