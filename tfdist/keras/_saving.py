"""Keras weights files of modules whose class tfdist swapped.

``fully_shard``, ``DistributedDataParallel`` and ``PostLocalSGDOptimizer``
give an object a class of torch's name (``FSDPDense`` for a ``Dense``).  Keras
files a layer of a list (a Sequential's layers, a model's list of blocks) in
a weights file under its class name in snake case (``saving_lib``:
``naming.to_snake_case(saveable.__class__.__name__)``), so ``fsdp_dense``
where a model without tfdist reads ``dense``: the file would not load into
it.  The name Keras makes is mapped back to the extended class's, on saving
and on loading alike.
"""

from __future__ import annotations

from tfdist import _patches, _registry
from tfdist.keras._keras_internals import naming

__all__ = ["install"]

_UNIQUE = "keras.src.saving.saving_lib:_get_unique_name"


def install() -> None:
    original = _patches.original(_UNIQUE)

    def unique_name(name, used_names):
        return original(_registry.original_class_name(name, naming.to_snake_case), used_names)

    _patches.install(_UNIQUE, unique_name)
