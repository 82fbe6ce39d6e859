"""MeshDistribution: a ``keras.distribution.Distribution`` over a tfdist DeviceMesh.

``parallelize_module`` sets one when no distribution is active, so that
variables made after it (optimizer slots, metrics, layers built lazily) are
created on the same mesh -- replicated unless a style gave them a layout.
"""

from __future__ import annotations

import keras

# Keras exports no base class for distributions; this is the one its own subclass.

from tfdist.device_mesh import DeviceMesh
from tfdist.keras._keras_internals import Distribution

__all__ = ["MeshDistribution"]


class MeshDistribution(Distribution):
    """Replicates variables on ``mesh`` and splits batches along ``batch_dim_name``."""

    def __init__(self, mesh: DeviceMesh, batch_dim_name: str | None = None) -> None:
        devices = [f"{mesh.device_type}:{i}" for i in mesh.mesh.ravel().tolist()]
        keras_mesh = keras.distribution.DeviceMesh(mesh.shape, list(mesh.axis_names), devices=devices)
        # Every client feeds the same global batch and places only its own
        # devices' slices (tfdist.keras._data), so Keras must not shard the
        # dataset per worker.
        super().__init__(keras_mesh, batch_dim_name, auto_shard_dataset=False)
        self._source_mesh = mesh  # tfdist's DeviceMesh (Keras keeps its own)

    @property
    def num_model_replicas(self) -> int:
        if self.batch_dim_name is None:
            return 1
        return self._source_mesh.size(self.batch_dim_name)

    def get_data_layout(self, data_shape):
        axes = [None] * len(data_shape)
        if self.batch_dim_name is not None and axes:
            axes[0] = self.batch_dim_name
        return keras.distribution.TensorLayout(axes, self.device_mesh)

    def get_variable_layout(self, variable):
        layout = getattr(variable, "_layout", None)
        if layout is not None:
            return layout
        return keras.distribution.TensorLayout([None] * len(variable.shape), self.device_mesh)

    def get_tensor_layout(self, path):
        return None
