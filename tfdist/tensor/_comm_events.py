"""How tfdist tells CommDebugMode which logical collective a TF kernel serves.

TF runs tfdist's reduce-scatter (Partial -> Shard) as an all-to-all kernel
(see ``_redistribute._program.Program.reduce_scatter``).  To count it under torch's
name ``reduce_scatter_tensor``:

- inside ``tf.function`` the all-to-all's relayout is built under a name
  scope registered here (``graph_scope``) with the collective's kernel,
  output bytes per device and group size.  TF keeps that name in the traced
  function (not always in the SPMD-expanded one), so CommDebugMode finds it
  in the functions the trace shows ran;
- eagerly, TF DTensor runs each relayout as its own function with generic
  node names, so tfdist reports the executed collective here, once per
  execution, to the modes that listen.
"""

from __future__ import annotations

import itertools
from typing import Callable

REDUCE_SCATTER_SCOPE = "tfdist_reduce_scatter"
_scopes: dict[str, tuple[str, str, float, int]] = {}
_ids = itertools.count()

# listener(logical name, TF kernel type, output bytes per device, group size)
Listener = Callable[[str, str, float, int], None]
_listeners: list[Listener] = []


def listening() -> bool:
    """True while some CommDebugMode is active (reports cost nothing otherwise)."""
    return bool(_listeners)


def listen(fn: Listener) -> None:
    _listeners.append(fn)


def unlisten(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def report(logical: str, kernel: str, output_bytes: float, group_size: int) -> None:
    """An eagerly executed ``kernel`` (of that output size per device) served ``logical``."""
    for fn in list(_listeners):
        fn(logical, kernel, output_bytes, group_size)


def graph_scope(logical: str, kernel: str, output_bytes: float, group_size: int) -> str:
    """A process-unique name scope marking a traced ``kernel`` that serves ``logical``."""
    name = f"{REDUCE_SCATTER_SCOPE}_{next(_ids)}"
    _scopes[name] = (logical, kernel, output_bytes, group_size)
    return name


def scoped_collective(segment: str) -> tuple[str, str, float, int] | None:
    """(logical, kernel, output bytes, group size) if ``segment`` is a scope from ``graph_scope``."""
    return _scopes.get(segment)
