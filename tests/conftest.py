"""Test set-up: 8 virtual CPU devices, once per test process."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tfdist  # noqa: E402

tfdist.virtual_cpus(8)

MESH_SHAPES = [(8,), (2, 4), (4, 2), (2, 2, 2)]
MESH_NAMES = {1: ("x",), 2: ("dp", "tp"), 3: ("a", "b", "c")}


def make_mesh(shape: tuple[int, ...]) -> tfdist.DeviceMesh:
    return tfdist.init_device_mesh("cpu", shape, mesh_dim_names=MESH_NAMES[len(shape)])


@pytest.fixture(params=MESH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def mesh(request) -> tfdist.DeviceMesh:
    return make_mesh(request.param)


@pytest.fixture
def mesh_2d() -> tfdist.DeviceMesh:
    return make_mesh((2, 4))


@pytest.fixture
def mesh_1d() -> tfdist.DeviceMesh:
    return make_mesh((8,))
