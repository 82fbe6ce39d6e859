"""visualize_sharding: which device holds which slice of a DTensor."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor as dtensor_api

from tfdist.tensor._api import DTensor

__all__ = ["visualize_sharding"]


def sharding_table(dt: DTensor) -> list[list[str]]:
    """Rows of (device, mesh coordinate, slice per dim, placement note) for every global device."""
    spec = dt._spec
    root = spec.mesh.root_mesh
    ids = root._ids
    rows = []
    for position in range(ids.size):
        device_id = int(ids.flat[position])
        coord = root._position_coordinate(position)
        shape, offset = spec.local_shape_and_offset(coord)
        slices = [f"{o}:{o + n}" if n else "empty" for o, n in zip(offset, shape)]
        partial = [
            f"{root.axis_names[m]}={spec.root_placements[m]}" for m in spec.partial_mesh_dims
        ]
        own = tuple(coord[m] for m in spec.mesh.root_dims)
        rows.append(
            [f"{root.device_type}:{device_id}", str(own), *slices, " ".join(partial)]
        )
    return rows


def _as_dtensor(value: Any) -> DTensor:
    """A tfdist DTensor, or a TF DTensor / variable on a mesh (a Keras variable) viewed as one."""
    if isinstance(value, DTensor):
        return value
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as err:
        raise TypeError(
            "visualize_sharding expects a tfdist DTensor, a TF DTensor or a variable on a mesh. "
            f"Received: {type(value).__name__}"
        ) from err
    if not dtensor_api.is_dtensor(tensor):
        raise TypeError(
            "visualize_sharding expects a value laid out on a mesh; this one lives on one device "
            f"(a {type(value).__name__} with no layout). Distribute it first."
        )
    return DTensor.from_tf(tensor)


def visualize_sharding(dtensor: DTensor | Any, header: str = "") -> str:
    """Prints (and returns) a table of the slice each device holds.

    Works in a terminal and in a notebook (plain monospaced text).  Takes a
    tfdist DTensor, a raw TF DTensor, or a variable laid out on a mesh (such
    as a Keras weight of a parallelized model).

    Example (6x8 tensor, [Shard(0), Shard(1)] on a 2x4 mesh)::

        device  coord   dim 0  dim 1
        cpu:0   (0, 0)  0:3    0:2
        cpu:1   (0, 1)  0:3    2:4
        ...
    """
    dtensor = _as_dtensor(dtensor)
    rows = sharding_table(dtensor)
    has_partial = any(r[-1] for r in rows)
    head = ["device", "coord"] + [f"dim {d}" for d in range(dtensor.ndim)]
    head += ["partial"] if has_partial else []
    body = [r if has_partial else r[:-1] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = [header] if header else []
    lines.append(
        f"shape {list(dtensor.shape)}  placements "
        f"({', '.join(str(p) for p in dtensor.placements)}) on {dtensor.device_mesh.axis_names}"
    )
    for row in [head, *body]:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    text = "\n".join(lines)
    print(text)
    return text
