"""Auto-wrap policies for ``FullyShardedDataParallel`` (torch.distributed.fsdp.wrap).

A policy is called as ``policy(module=layer, recurse=False, nonwrapped_numel=n)``
and returns True when ``layer`` should become its own FSDP unit; ``n`` counts
the elements of the layer's trainable variables that no wrapped sublayer holds.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["ModuleWrapPolicy", "CustomPolicy", "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
           "always_wrap_policy"]


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


class CustomPolicy:
    """Wraps the layers ``lambda_fn(layer)`` picks; a dict instead of True gives that unit its own
    FSDP1 arguments (``sharding_strategy``, ``mixed_precision``), overriding the root's, as in torch.

    Example::

        policy = CustomPolicy(lambda layer: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
                              if isinstance(layer, Block) else False)
        FullyShardedDataParallel(model, auto_wrap_policy=policy)
    """

    def __init__(self, lambda_fn: Callable[[Any], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy needs a callable taking a layer. Received: lambda_fn={lambda_fn!r}")
        self._lambda_fn = lambda_fn

    def __call__(self, module: Any, recurse: bool, nonwrapped_numel: int) -> bool | dict[str, Any]:
        if recurse:
            return True
        decision = self._lambda_fn(module)
        if not isinstance(decision, (bool, dict)):
            raise TypeError(f"CustomPolicy: lambda_fn must return a bool or a dict of FSDP arguments; it returned "
                            f"{decision!r} for layer {getattr(module, 'name', module)!r}.")
        return decision


def transformer_auto_wrap_policy(
    module: Any, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: Iterable[type] = (),
) -> bool:
    """Wraps every layer whose class is in ``transformer_layer_cls`` (torch's function form of
    ``ModuleWrapPolicy``).

    Example::

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    """
    return recurse or isinstance(module, tuple(transformer_layer_cls))


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
