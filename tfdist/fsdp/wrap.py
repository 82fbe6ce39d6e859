"""Auto-wrap policies for ``FullyShardedDataParallel`` (torch.distributed.fsdp.wrap).

A policy is called as ``policy(module=layer, recurse=False, nonwrapped_numel=n)``
and returns True when ``layer`` should become its own FSDP unit; ``n`` counts
the elements of the layer's trainable variables that no wrapped sublayer holds.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["ModuleWrapPolicy", "size_based_auto_wrap_policy", "always_wrap_policy"]


class ModuleWrapPolicy:
    """Wraps every layer whose class is one of ``module_classes`` (e.g. a transformer block).

    Example::

        FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    """

    def __init__(self, module_classes: Iterable[type]) -> None:
        classes = tuple(module_classes)
        if not classes or not all(isinstance(c, type) for c in classes):
            raise ValueError(f"ModuleWrapPolicy needs layer classes. Received: module_classes={module_classes!r}")
        self.module_classes = classes

    def __call__(self, module: Any, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, self.module_classes)


def size_based_auto_wrap_policy(
    module: Any, recurse: bool, nonwrapped_numel: int, min_num_params: int = int(1e8),
) -> bool:
    """Wraps a layer once its not-yet-wrapped parameters reach ``min_num_params`` elements.

    Example::

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10_000)
    """
    return recurse or nonwrapped_numel >= min_num_params


def always_wrap_policy(module: Any, recurse: bool, nonwrapped_numel: int) -> bool:
    """Wraps every layer that holds parameters of its own."""
    return True
