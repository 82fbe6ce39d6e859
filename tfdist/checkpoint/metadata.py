"""What a checkpoint holds, independent of where its bytes are (torch.distributed.checkpoint.metadata).

``Metadata`` is written last, atomically, as JSON in ``<checkpoint>/.metadata``:
one entry per fully qualified name (global shape, dtype, the chunks that were
written) plus the storage's own data (the bundle the bytes live in, file sizes
and checksums).  Its ``version`` is checked on load.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Union

from tfdist.tensor._api import ChunkStorageMetadata

__all__ = [
    "FORMAT_VERSION", "ChunkStorageMetadata", "MetadataIndex", "TensorProperties", "TensorStorageMetadata",
    "BytesStorageMetadata", "StorageMeta", "Metadata", "STORAGE_TYPES",
]

# Bumped whenever the layout of .metadata or of the data files changes.
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class MetadataIndex:
    """Names one value (``fqn``) or one chunk of it (its global ``offset``)."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = dataclasses.field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.offset is not None:
            object.__setattr__(self, "offset", tuple(int(o) for o in self.offset))


@dataclasses.dataclass
class TensorProperties:
    """How a tensor is stored: its TensorFlow dtype name (``"float32"``, ``"bfloat16"``)."""

    dtype: str


@dataclasses.dataclass
class TensorStorageMetadata:
    """A tensor's global ``size`` and the ``chunks`` (offsets, sizes) its writers stored."""

    properties: TensorProperties
    size: tuple[int, ...]
    chunks: list[ChunkStorageMetadata]


@dataclasses.dataclass
class BytesStorageMetadata:
    """A non-tensor value (stored pickled)."""


STORAGE_TYPES = Union[TensorStorageMetadata, BytesStorageMetadata]


@dataclasses.dataclass
class StorageMeta:
    checkpoint_id: str | None = None
    save_id: str | None = None


@dataclasses.dataclass
class Metadata:
    """Everything a load needs to plan: the values by name, and the storage's data."""

    state_dict_metadata: dict[str, STORAGE_TYPES]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        entries = {}
        for fqn, md in self.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                entries[fqn] = {
                    "kind": "tensor", "dtype": md.properties.dtype, "size": list(md.size),
                    "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
                }
            else:
                entries[fqn] = {"kind": "bytes"}
        meta = dataclasses.asdict(self.storage_meta) if self.storage_meta else None
        return json.dumps({
            "format": "tfdist.checkpoint", "version": self.version, "state_dict_metadata": entries,
            "planner_data": self.planner_data, "storage_data": self.storage_data, "storage_meta": meta,
        }, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str, source: str = ".metadata") -> Metadata:
        """Parses ``.metadata``; a wrong format or version raises ValueError naming ``source``."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} is not a tfdist checkpoint metadata file (not JSON: {e}).") from None
        if not isinstance(raw, dict) or raw.get("format") != "tfdist.checkpoint":
            raise ValueError(f"{source} is not a tfdist checkpoint metadata file.")
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{source} has checkpoint format version {raw.get('version')!r}; this tfdist reads version "
                f"{FORMAT_VERSION}. Convert it with the tfdist release that wrote it."
            )
        entries: dict[str, STORAGE_TYPES] = {}
        for fqn, e in raw["state_dict_metadata"].items():
            if e["kind"] == "tensor":
                chunks = [ChunkStorageMetadata(offsets=tuple(o), sizes=tuple(s)) for o, s in e["chunks"]]
                entries[fqn] = TensorStorageMetadata(TensorProperties(e["dtype"]), tuple(e["size"]), chunks)
            else:
                entries[fqn] = BytesStorageMetadata()
        meta = StorageMeta(**raw["storage_meta"]) if raw.get("storage_meta") else None
        return Metadata(entries, raw.get("planner_data"), raw.get("storage_data"), meta, raw["version"])
