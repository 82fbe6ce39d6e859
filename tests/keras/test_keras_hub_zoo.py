"""keras-hub's model zoo under layout maps a user writes, against one device.

The families are keras-hub's exported ``*Backbone`` classes, enumerated (tests/keras/hub_zoo.py),
each built tiny from its signature.  For each family, mesh and map (keras-hub's Llama pattern
written from the family's own variable paths, or a random map): the layouts TF holds are the
map's, the eager call and ``predict`` equal one device's, and ``fit`` with SGD (so a wrongly
scaled gradient shows) reports one device's losses and ends at its weights.  Three sampled
families run in the default suite; every family, mesh and map kind in the slow suite.
"""

from __future__ import annotations

import random

import pytest

import tfdist.keras  # noqa: F401  (the TF backend of keras.distribution)
from keras_helpers import no_global_distribution  # noqa: F401

pytest.importorskip("keras_hub", reason="keras-hub is a test extra: pip install -e '.[test]'")
import hub_zoo  # noqa: E402

FAMILIES = [name for name in hub_zoo.text_backbones() if not isinstance(hub_zoo.tiny_config(name), str)]
SAMPLED = set(random.Random(68).sample(FAMILIES, 3))
MESHES = [(2, 4), (4, 2), (1, 8)]


def _cases():
    for name in FAMILIES:
        for shape in MESHES:
            for kind in ("llama", "random"):
                default = name in SAMPLED and shape == (2, 4) and kind == "llama"
                marks = () if default else (pytest.mark.slow,)
                yield pytest.param(name, shape, kind, marks=marks, id=f"{name}-{shape[0]}x{shape[1]}-{kind}")


@pytest.mark.parametrize("name, mesh_shape, kind", list(_cases()))
def test_family_under_a_layout_map_is_one_device(no_global_distribution, name, mesh_shape, kind):
    hub_zoo.check(name, mesh_shape, kind)
