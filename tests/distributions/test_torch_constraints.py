"""tfdist.distributions.constraints' ``check`` against torch 2.13's for edge values: integers at
infinity and NaN, huge floats, interval ends, nearly symmetric and singular matrices
(fixtures/torch_constraints.json, written by fixtures/generate_torch_constraints.py)."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

from tfdist.distributions import constraints

CASES = json.loads((pathlib.Path(__file__).parent / "fixtures" / "torch_constraints.json").read_text())["cases"]


def dec(x):
    if isinstance(x, list):
        return [dec(v) for v in x]
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(x, x)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["constraint"])
def test_check_equals_torchs(case):
    constraint = getattr(constraints, case["constraint"])
    if case["args"]:
        constraint = constraint(*case["args"])
    got = np.asarray(constraint.check(np.array(dec(case["value"]), np.float64)))
    want = np.asarray(case["check"])
    assert got.shape == want.shape
    wrong = [(v, g, w) for v, g, w in zip(dec(case["value"]), got.tolist(), want.tolist()) if g != w]
    assert not wrong, f"(value, tfdist, torch): {wrong}"


def test_positive_semidefinite_maps_as_torchs_registries_do():
    """torch: transform_to(positive_semidefinite) is PositiveDefiniteTransform; biject_to has none."""
    from tfdist.distributions import biject_to, transform_to

    t = transform_to(constraints.positive_semidefinite)
    assert type(t).__name__ == "PositiveDefiniteTransform"
    out = np.asarray(t(np.array([[0.3, 0.0], [-1.2, 0.1]])))
    assert bool(np.asarray(constraints.positive_semidefinite.check(out)))
    with pytest.raises(NotImplementedError, match="PositiveSemidefinite"):
        biject_to(constraints.positive_semidefinite)
