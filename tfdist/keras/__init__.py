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
    layout_map[".*dense.*kernel"] = (None, "model")  # Keras matches whole paths: "sequential/dense/kernel"
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = make_model(); model.compile(...); model.fit(x, y, batch_size=16)

What importing it changes, and where: the rows of ``tfdist._patches.PATCHES``
(each with its reason and the Keras/TF version it was written against) are
installed here, at import, and nowhere else -- ``import tfdist.keras`` is the
one place.  ``parallelize_module``, ``fully_shard`` and ``distribute_module``
import this package when they first meet a Keras model (Keras' own way of
loading a backend by name), so calling them on a Keras model installs the
rows too; ``tfdist.tensor`` alone installs nothing.  Every row first asks
whether the call involves tfdist (a keras distribution, a variable or tensor
on a mesh) and otherwise runs Keras' or TF's own code: a plain model in the
same process traces the same graph and computes the same values
(tests/test_architecture.py; cost: benchmarks/plain_code_overhead.py).
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

from tfdist.tensor import _legalize  # noqa: E402
from tfdist.keras import (  # noqa: E402
    _backend, _callbacks, _expandable_ops, _host_tensors, _optimizer, _random_layers, _saving, _trainer, _variables,
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
_legalize.install()
_saving.install()

from tfdist.keras import _modules  # noqa: E402,F401  (registers the Keras ModuleBackend)
from tfdist.keras._layout_map import LayoutMap  # noqa: E402
from tfdist.keras._summary import summary  # noqa: E402
from tfdist.keras._checkpoint_callback import DistributedCheckpoint  # noqa: E402

__all__ = ["LayoutMap", "summary", "DistributedCheckpoint"]
