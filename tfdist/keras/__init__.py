"""tfdist.keras: Keras 3 (TensorFlow backend) on TF DTensor.

Importing it makes ``keras.distribution`` (DeviceMesh, TensorLayout,
LayoutMap, DataParallel, ModelParallel, set_distribution) work on the
TensorFlow backend, where Keras 3 leaves it unimplemented: variables become
``dtensor.DVariable``s with the layouts the distribution gives, and
``model.fit/evaluate/predict`` feed batch-sharded DTensors.

Example::

    import keras, tfdist, tfdist.keras
    tfdist.virtual_cpus(8)
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = make_model(); model.compile(...); model.fit(x, y, batch_size=16)
"""

from __future__ import annotations

import keras

from tfdist import _patches

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        "tfdist.keras needs the TensorFlow backend of Keras 3; set KERAS_BACKEND=tensorflow "
        f"before importing keras. Current backend: {keras.backend.backend()!r}"
    )
_patches.check_versions()

from tfdist.keras import (  # noqa: E402
    _backend, _callbacks, _expandable_ops, _host_tensors, _optimizer, _random_layers, _trainer, _variables,
)

# Every change to Keras internals is a row of tfdist._patches.PATCHES.
_backend.install()
_variables.install()
_optimizer.install()
_trainer.install()
_callbacks.install()
_host_tensors.install()
_random_layers.install()
_expandable_ops.install()

from tfdist.keras import _modules  # noqa: E402,F401  (registers the Keras ModuleBackend)
from tfdist.keras._layout_map import LayoutMap  # noqa: E402
from tfdist.keras._summary import summary  # noqa: E402
from tfdist.keras._checkpoint_callback import DistributedCheckpoint  # noqa: E402

__all__ = ["LayoutMap", "summary", "DistributedCheckpoint"]
