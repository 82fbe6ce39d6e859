"""docs/migration.md agrees with the committed name lists, and the lists agree with what imports."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tables():
    spec = importlib.util.spec_from_file_location("make_tables", ROOT / "docs" / "migration" / "make_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = _tables()
TORCH_NAMES, CONCEPTS = TABLES.load()


def _resolve(path: str) -> bool:
    """Whether ``path`` names a module, or an attribute reached from the longest importable module."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_the_page_is_the_generators_output():
    assert (ROOT / "docs" / "migration.md").read_text() == TABLES.render(), \
        "docs/migration.md is out of date: run python docs/migration/make_tables.py"


def test_fsdp_page_lists_every_fsdp_name_of_the_specification():
    text = (ROOT / "docs" / "fsdp.md").read_text()
    assert text == TABLES.fsdp_page(), "docs/fsdp.md's name list is out of date: run python docs/migration/make_tables.py"
    listed = {e["torch"] for e in TORCH_NAMES if TABLES._group(e["torch"]) in TABLES.FSDP_GROUPS}
    assert len(listed) >= 40 and all(f"| `{name}` |" in text for name in listed)


@pytest.mark.parametrize("entry", TORCH_NAMES, ids=lambda e: e["torch"])
def test_each_torch_name_has_the_status_the_table_gives(entry):
    """A name said to work (or to work with a difference, or to refuse) exists at tfdist's path; a name
    said not to exist yet does not: adding it fails this test until the table says so."""
    assert entry["status"] in TABLES.STATUS
    exists = _resolve(TABLES.tfdist_path(entry["torch"]))
    assert exists == (entry["status"] != "not yet"), (entry["torch"], entry["status"])
    if entry["status"] in ("difference", "refused"):
        assert entry["note"], f"{entry['torch']}: say what differs or why it is refused"


def test_the_name_list_covers_the_specification_once():
    names = [e["torch"] for e in TORCH_NAMES]
    assert len(names) == len(set(names))
    assert all(n.startswith(("torch.distributed.", "torch.distributions.")) for n in names)
    assert len(names) >= 240  # what the specification names, plus the members torch users call most


def test_no_name_is_refused_any_more():
    """The last refusals (CPU offload) were built: the table lists none, and both names act --
    the offloaded shards live on a host mesh (tests/fsdp/test_cpu_offload.py trains with them)."""
    import keras

    import tfdist.fsdp as fsdp
    from tfdist.fsdp import _offload

    assert {e["torch"] for e in TORCH_NAMES if e["status"] == "refused"} == set()
    layer = keras.layers.Dense(4)
    layer.build((None, 8))
    fsdp.fully_shard(layer, offload_policy=fsdp.CPUOffloadPolicy())
    assert all(_offload.is_offloaded(v) for v in layer.trainable_variables)
    model = fsdp.FullyShardedDataParallel(keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)]),
                                          cpu_offload=fsdp.CPUOffload(offload_params=True))
    assert all(_offload.is_offloaded(v) for v in model.trainable_variables)


@pytest.mark.parametrize("concept", CONCEPTS, ids=lambda c: c["tf"])
def test_each_tf_dtensor_concept_points_at_names_that_exist(concept):
    for name in concept["tfdist"]:
        assert _resolve(name), name
