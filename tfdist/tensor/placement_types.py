"""Placement types: how a DTensor sits on one mesh dimension.

``Shard(dim)`` splits tensor dim ``dim`` over the mesh dim (``torch.chunk``
semantics), ``Replicate()`` copies it, ``Partial(reduce_op)`` holds values
that still need a reduction over the mesh dim.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Placement", "Shard", "Replicate", "Partial"]

_REDUCE_OPS = ("sum", "avg", "product", "max", "min")


class Placement:
    """Base class of Shard, Replicate and Partial."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """True for ``Shard`` (of ``dim``, when given)."""
        return False

    def is_replicate(self) -> bool:
        """True for ``Replicate``."""
        return False

    def is_partial(self) -> bool:
        """True for ``Partial``."""
        return False


@dataclasses.dataclass(frozen=True)
class Shard(Placement):
    """Shards tensor dimension ``dim`` over one mesh dimension.

    Shard ``i`` of ``k`` holds ``torch.chunk(x, k, dim)[i]``: chunks of
    ``ceil(n / k)`` rows, the last ones shorter or empty when ``n % k != 0``.

    Example:
        >>> Shard(0), str(Shard(1))
        (Shard(dim=0), 'S(1)')
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(
                f"Shard dim must be an int. Received: dim={self.dim!r}"
            )

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate(Placement):
    """Every device of the mesh dimension holds the whole tensor.

    Example:
        >>> Replicate(), str(Replicate())
        (Replicate(), 'R')
    """

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclasses.dataclass(frozen=True)
class Partial(Placement):
    """Each device holds a partial value; the tensor is their reduction.

    Args:
        reduce_op: one of ``"sum"``, ``"avg"``, ``"product"``, ``"max"``, ``"min"``.

    Example:
        >>> Partial(), str(Partial("max"))
        (Partial(reduce_op='sum'), 'P(max)')
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(
                f"reduce_op must be one of {_REDUCE_OPS}. "
                f"Received: reduce_op={self.reduce_op!r}"
            )

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"P({self.reduce_op})"
