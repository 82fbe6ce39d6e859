"""placements -> TF layout -> placements, over random meshes, slices and placements (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tensorflow.experimental import dtensor

from conftest import MESH_SHAPES, make_mesh
from tfdist.tensor._layout import DTensorSpec, placements_from_tf_layout, to_root_placements
from tfdist.tensor.placement_types import Partial, Replicate, Shard

MESHES = {shape: make_mesh(shape) for shape in MESH_SHAPES}


@st.composite
def cases(draw):
    root = MESHES[draw(st.sampled_from(MESH_SHAPES))]
    names = root.axis_names
    keep = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    mesh = root[tuple(n for n in names if n in keep)]
    rank = draw(st.integers(1, 3))
    dims = draw(st.permutations(range(rank)))
    placements = []
    for i in range(mesh.ndim):
        kind = draw(st.sampled_from(["R", "S", "P"] if i < rank else ["R", "P"]))
        if kind == "S" and i < len(dims):
            placements.append(Shard(dims[i]))
        elif kind == "P":
            placements.append(Partial(draw(st.sampled_from(["sum", "avg", "max"]))))
        else:
            placements.append(Replicate())
    shape = tuple(draw(st.integers(1, 9)) for _ in range(rank))
    return mesh, tuple(placements), shape


@settings(max_examples=800, deadline=None)
@given(cases())
def test_layout_encodes_placements_and_decodes_back(case):
    mesh, placements, shape = case
    spec = DTensorSpec(mesh, placements, shape)
    root = to_root_placements(mesh, placements)
    assert spec.root_placements == root
    layout = spec.tf_layout
    names = mesh.root_mesh.axis_names
    partial_dims = [m for m, p in enumerate(root) if p.is_partial()]
    lead = len(partial_dims)
    # the stacked Partial axes come first, sharded on their mesh dims, in mesh-dim order
    assert list(layout.sharding_specs[:lead]) == [names[m] for m in partial_dims]
    logical = dtensor.Layout(list(layout.sharding_specs[lead:]), layout.mesh)
    decoded = placements_from_tf_layout(logical)
    assert decoded == tuple(Replicate() if p.is_partial() else p for p in root)
    # every logical dim holds padded_size rows, divisible by the devices that shard it
    assert spec.physical_shape[lead:] == tuple(spec.padded_size(d) for d in range(len(shape)))
