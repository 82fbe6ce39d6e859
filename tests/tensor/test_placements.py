from __future__ import annotations

import dataclasses

import pytest

from tfdist.tensor import Partial, Placement, Replicate, Shard


def test_repr_evaluates_back_and_str_is_short():
    for p in (Shard(0), Shard(2), Replicate(), Partial(), Partial("max")):
        assert eval(repr(p)) == p
    assert [str(p) for p in (Shard(1), Replicate(), Partial("avg"))] == ["S(1)", "R", "P(avg)"]


def test_frozen_and_hashable():
    assert len({Shard(0), Shard(0), Shard(1), Replicate(), Replicate(), Partial()}) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shard(0).dim = 1


def test_predicates():
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicate() and not Replicate().is_shard()
    assert Partial().is_partial() and not Partial().is_replicate()
    assert isinstance(Shard(0), Placement)


def test_subclasses_never_equal_each_other():
    assert Shard(0) != Replicate() and Replicate() != Partial()


@pytest.mark.parametrize("op", ["sum", "avg", "product", "max", "min"])
def test_partial_reduce_ops(op):
    assert Partial(op).reduce_op == op


def test_bad_input():
    with pytest.raises(ValueError, match="reduce_op must be one of"):
        Partial("mean")
    with pytest.raises(TypeError, match="Shard dim must be an int"):
        Shard("0")
