"""``average_parameters`` (torch.distributed.algorithms.model_averaging.utils)."""

from __future__ import annotations

from typing import Any, Iterable

from tfdist.nn.parallel._replicas import replica_mean, replicas_of

__all__ = ["average_parameters", "average_parameters_or_parameter_groups"]


def _check_group(process_group: Any) -> None:
    if process_group is not None:
        raise ValueError("model averaging: process_group must be None (every replica of the module's mesh) in "
                         f"tfdist. Received: process_group={process_group!r}")


def average_parameters(params: Iterable[Any], process_group: Any = None) -> None:
    """Sets every replica of each parameter to the replicas' mean (one all-reduce per parameter) and
    the module's own variable to it.  ``params``: ``DistributedDataParallel``'s stacked replicas
    (``model.trainable_variables``); a variable that is not one has a single value and is left.

    Example::

        average_parameters(model.trainable_variables)
    """
    _check_group(process_group)
    for variable in params:
        found = replicas_of(variable)
        if found is None:
            continue
        original, replicas = found
        mean, rows = replica_mean(variable.value, replicas.mesh, replicas.dp)
        variable.assign(rows)
        original.assign(mean)


def average_parameters_or_parameter_groups(params: Iterable[Any], process_group: Any = None) -> None:
    """``average_parameters`` for a list of variables or of param-group dicts (``{"params": [...]}``)."""
    params = list(params)
    flat = [v for p in params for v in (p["params"] if isinstance(p, dict) else [p])]
    average_parameters(flat, process_group)
