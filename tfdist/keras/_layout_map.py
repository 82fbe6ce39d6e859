"""LayoutMap: keras.distribution.LayoutMap whose values may also be tfdist styles or placements.

Keys are regular expressions on variable paths, as in Keras.  A value may be

* a ``keras.distribution.TensorLayout`` or a tuple of axis names (Keras),
* tfdist placements, one per mesh dim (``(Replicate(), Shard(1))``),
* a tensor-parallel style (``ColwiseParallel()``, ``RowwiseParallel()``): the
  variable takes the placement the style gives to that weight of its layer
  (a Dense kernel is ``Shard(1)`` under Colwise); the style's mesh dim is the
  map's ``tp_dim_name`` (default: the mesh's last dim),
* ``tfdist.fsdp.FSDPStyle(...)``: a trainable variable is sharded over the
  data-parallel dim (default: the mesh's first) on its first dim that divides
  evenly, after its ``tp_style`` placement; its layer then gathers and
  reduce-scatters as under ``fully_shard``.

A style in a layout map lays out variables only; ``parallelize_module`` also
relayouts the layer's inputs and outputs (a fixed Megatron comm pattern).
"""

from __future__ import annotations

from typing import Any

from keras.distribution import LayoutMap as KerasLayoutMap
from tensorflow.experimental import dtensor
from keras.distribution import TensorLayout

from tfdist.fsdp import FSDPStyle
from tfdist.keras._backend import tfdist_mesh
from tfdist.keras._modules import KerasModules
from tfdist.tensor.parallel.style import ParallelStyle
from tfdist.tensor.placement_types import Placement, Replicate, Shard

__all__ = ["LayoutMap"]


class LayoutMap(KerasLayoutMap):
    """A ``keras.distribution.LayoutMap`` that also takes styles and placements.

    Example::

        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
        layout_map = tfdist.keras.LayoutMap(mesh)
        layout_map[".*mlp/dense/.*"] = ColwiseParallel()
        layout_map[".*mlp/dense_1/kernel"] = (Shard(0), Replicate())   # placements per mesh dim
        layout_map[".*embeddings"] = (None, "model")                     # Keras axes
        layout_map["dense.*/output"] = ("batch", None)                   # an activation layout

    A key that matches no variable and no layer output is reported when the
    model first trains, evaluates or predicts: a warning (Keras ignores such
    keys, and libraries' maps carry keys for optional layers), an error with
    ``strict=True``.
    """

    def __init__(self, device_mesh: Any, tp_dim_name: str | None = None, strict: bool = False) -> None:
        super().__init__(device_mesh)
        if not isinstance(strict, bool):
            raise ValueError(f"strict must be a bool. Received: strict={strict!r}")
        self.strict = strict
        self.tp_dim_name = tp_dim_name or device_mesh.axis_names[-1]
        if self.tp_dim_name not in device_mesh.axis_names:
            raise ValueError(
                f"tp_dim_name must be a dim of the mesh {device_mesh.axis_names}. "
                f"Received: tp_dim_name={tp_dim_name!r}"
            )

    def __setitem__(self, key: str, layout: Any) -> None:
        if isinstance(layout, FSDPStyle) and layout.tp_style is not None and not isinstance(
                layout.tp_style, ParallelStyle):
            raise ValueError(f"FSDPStyle(tp_style=...) must be a ParallelStyle. Received: {layout.tp_style!r}")
        if isinstance(layout, (ParallelStyle, FSDPStyle)):
            if key in self._layout_map:
                raise ValueError(f"{key} already exists in the LayoutMap with value {self._layout_map[key]}.")
            self._layout_map[key] = layout
            return
        if isinstance(layout, (tuple, list)) and layout and all(isinstance(p, Placement) for p in layout):
            layout = _StaticPlacements(tuple(layout), self.device_mesh)
            self._layout_map[key] = layout
            return
        super().__setitem__(key, layout)

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if value is None or isinstance(value, TensorLayout):
            return value
        return _ResolveLater(value, self, key)


_MODULES = KerasModules()


class _StaticPlacements:
    def __init__(self, placements: tuple[Placement, ...], mesh: Any) -> None:
        if len(placements) != len(mesh.axis_names):
            raise ValueError(
                f"placements has {len(placements)} entries but the mesh has "
                f"{len(mesh.axis_names)} dims {tuple(mesh.axis_names)}. Received: {placements!r}"
            )
        self.placements, self.mesh = placements, mesh

    def __repr__(self) -> str:
        return f"placements{self.placements}"


class _ResolveLater:
    """A style/placements value, turned into a TensorLayout once the variable's rank is known."""

    def __init__(self, value: Any, layout_map: LayoutMap, path: str) -> None:
        self.value, self.layout_map, self.path = value, layout_map, path

    def for_tensor(self, tensor: Any) -> TensorLayout | None:
        """Keras also maps layer outputs ("<layer>/output"): placements apply, styles do not."""
        if not isinstance(self.value, _StaticPlacements):
            return None
        return self._axes(self.value.placements, len(tensor.shape), self.path)

    def for_variable(self, variable: Any, layer: Any) -> TensorLayout:
        mesh = self.layout_map.device_mesh
        if isinstance(self.value, _StaticPlacements):
            placements = self.value.placements
        elif isinstance(self.value, FSDPStyle):
            placements = self._from_fsdp(variable, layer, mesh)
        else:
            placements = self._from_style(variable, layer, mesh)
        return self._axes(placements, len(variable.shape), variable.path)

    def _from_fsdp(self, variable: Any, layer: Any, mesh: Any):
        style = self.value
        dp = style.dim_name or mesh.axis_names[0]
        if dp not in mesh.axis_names:
            raise ValueError(f"FSDPStyle(dim_name={dp!r}) is not a dim of the mesh {tuple(mesh.axis_names)}.")
        placements = [Replicate()] * len(mesh.axis_names)
        if style.tp_style is not None:
            placements = list(_ResolveLater(style.tp_style, self.layout_map, self.path)._from_style(
                variable, layer, mesh))
        if not getattr(variable, "trainable", True) or layer is None:
            return tuple(placements)
        specs = [dtensor.UNSHARDED] * len(variable.shape)
        for name, p in zip(mesh.axis_names, placements):
            if isinstance(p, Shard):
                specs[p.dim % len(specs)] = name
        d = style.shard_dim(tuple(variable.shape), specs, mesh.shape[list(mesh.axis_names).index(dp)])
        if d is not None:
            placements[list(mesh.axis_names).index(dp)] = Shard(d)
            style.attach(_MODULES, layer, tfdist_mesh(mesh)[dp])
        return tuple(placements)

    def _axes(self, placements, rank: int, what: str) -> TensorLayout:
        mesh = self.layout_map.device_mesh
        axes: list[str | None] = [None] * rank
        for name, p in zip(mesh.axis_names, placements):
            if isinstance(p, Shard):
                if not -rank <= p.dim < rank:
                    raise ValueError(
                        f"{what!r}: {p!r} is out of range for a rank-{rank} variable (valid: "
                        f"{-rank}..{rank - 1}). Received: placements={placements!r}"
                    )
                dim = p.dim % rank
                if axes[dim] is not None:
                    raise ValueError(f"{what!r}: dim {dim} sharded twice by {placements!r}")
                axes[dim] = name
            elif p.is_partial():
                raise ValueError(f"{what!r}: a layout-map value cannot be Partial ({placements!r})")
        return TensorLayout(tuple(axes), mesh)

    def _from_style(self, variable: Any, layer: Any, mesh: Any):
        if layer is None:
            raise ValueError(
                f"LayoutMap key {self.path!r} maps to a style, which needs the variable's layer; "
                f"variable {variable.path!r} was not created by a layer."
            )
        tp = tfdist_mesh(mesh)[self.layout_map.tp_dim_name]
        weights = self.value.weight_placements(layer, tp, _MODULES)
        tp_placement = weights.get(variable.name, [Replicate()])[0]
        return tuple(
            tp_placement if name == self.layout_map.tp_dim_name else Replicate() for name in mesh.axis_names
        )
