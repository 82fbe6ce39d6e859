"""Test set-up: 8 virtual CPU devices, once per test process."""

from __future__ import annotations

import os
import pathlib

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


# -- the slow suite's list (tests/slow_suite.txt) ------------------------------------------
_SLOW_LIST = pathlib.Path(__file__).with_name("slow_suite.txt")


def _slow_ids() -> set[str]:
    lines = (line.split("#")[0].strip() for line in _SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line}


_MULTI_PROCESS_FILES = {"tests/test_multiclient.py", "tests/checkpoint/test_kill.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    """Marks the tests tests/slow_suite.txt lists as slow (run by ``pytest -m slow``); an id that
    names no test of a collected file is an error, so the list follows renames."""
    ids = _slow_ids()
    matched: set[str] = set()
    for item in items:
        nodeid = item.nodeid.replace("\\", "/")
        if nodeid.split("::")[0] in _MULTI_PROCESS_FILES:
            # under pytest-xdist (CI's slow suite) jobs of several client processes run one at a
            # time on one worker: two at once on a 2-core machine would only race their timeouts
            item.add_marker(pytest.mark.xdist_group("clients"))
        for key in (nodeid, nodeid.split("[")[0]):
            if key in ids:
                item.add_marker(pytest.mark.slow)
                matched.add(key)
    # files collected whole (a run of chosen test ids would report the others as missing)
    files = {item.nodeid.split("::")[0] for item in items} - {a.split("::")[0] for a in config.args if "::" in a}
    stale = sorted(i for i in ids - matched if i.split("::")[0] in files)
    if stale:
        raise pytest.UsageError(f"tests/slow_suite.txt names tests that do not exist: {stale}")
