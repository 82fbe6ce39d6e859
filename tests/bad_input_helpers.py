"""Shared by the bad-input tests: an API misuse is refused with a clear message, and the process
stays usable (a valid round trip works right after)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_mesh
from tfdist.tensor import Replicate, Shard, distribute_tensor

X = np.arange(48.0, dtype=np.float32).reshape(6, 8)


def round_trip_still_works() -> None:
    mesh = make_mesh((2, 4))
    d = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    np.testing.assert_array_equal(d.redistribute(mesh, [Replicate(), Shard(0)]).full_tensor().numpy(), X)


def check_refused(fn, exc, fragment: str | None) -> None:
    """``fn()`` raises ``exc`` whose message contains ``fragment`` (any message if None), and
    a valid round trip then still works."""
    with pytest.raises(exc) as info:
        fn()
    if fragment:
        assert fragment.lower() in str(info.value).lower(), str(info.value)
    round_trip_still_works()
