"""Splitting a batch into microbatches and merging them back (torch.distributed.pipelining.microbatch)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"]


class TensorChunkSpec:
    """Split (and merge) a tensor along ``split_dim``.

    Example::

        split_args_kwargs_into_chunks((x,), {}, 4, args_chunk_spec=(TensorChunkSpec(0),))
    """

    def __init__(self, split_dim: int) -> None:
        if isinstance(split_dim, bool) or not isinstance(split_dim, int):
            raise TypeError(f"split_dim must be an int. Received: split_dim={split_dim!r}")
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorChunkSpec) and other.split_dim == self.split_dim

    __hash__ = None  # type: ignore[assignment]


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (tf.Tensor, np.ndarray)) or tf.is_tensor(x)


def _split(value: Any, spec: TensorChunkSpec | None, chunks: int, name: str) -> list[Any]:
    if not _is_tensor(value) or spec is None:
        return [value] * chunks  # replicated into every microbatch (torch's _Replicate)
    shape = tuple(value.shape)
    dim = spec.split_dim % len(shape)
    size = shape[dim]
    if size is None or size % chunks:
        raise ValueError(
            f"{name}: a batch of {size} along dim {dim} does not split into n_microbatches={chunks} equal "
            f"microbatches; use a batch size that is a multiple of {chunks}."
        )
    return list(tf.split(tf.convert_to_tensor(value), chunks, axis=dim))


def split_args_kwargs_into_chunks(
    args: tuple[Any, ...], kwargs: dict[str, Any] | None, chunks: int,
    args_chunk_spec: Sequence[TensorChunkSpec | None] | None = None,
    kwargs_chunk_spec: dict[str, TensorChunkSpec | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """``chunks`` microbatches of ``args`` and ``kwargs``: tensors split along their spec's dim
    (dim 0 by default), anything else repeated.  An uneven split is an error naming the batch size.

    Example::

        args_split, kwargs_split = split_args_kwargs_into_chunks((x,), {"mask": m}, 4)
        len(args_split)   # 4
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int. Received: chunks={chunks!r}")
    kwargs = kwargs or {}
    if args_chunk_spec is None:
        args_chunk_spec = [TensorChunkSpec(0)] * len(args)
    if len(args_chunk_spec) != len(args):
        raise ValueError(f"args_chunk_spec has {len(args_chunk_spec)} entries for {len(args)} args.")
    kwargs_chunk_spec = kwargs_chunk_spec or {k: TensorChunkSpec(0) for k in kwargs}
    split_args = [_split(a, s, chunks, f"args[{i}]") for i, (a, s) in enumerate(zip(args, args_chunk_spec))]
    split_kwargs = {k: _split(v, kwargs_chunk_spec.get(k, TensorChunkSpec(0)), chunks, f"kwargs[{k!r}]")
                    for k, v in kwargs.items()}
    return ([tuple(a[i] for a in split_args) for i in range(chunks)],
            [{k: v[i] for k, v in split_kwargs.items()} for i in range(chunks)])


def merge_chunks(chunks: list[Any], chunk_spec: Any = None) -> Any:
    """Concatenates per-microbatch outputs along each spec's dim (dim 0 by default); tuples and dicts
    are merged element-wise.

    Example::

        merge_chunks([y0, y1, y2, y3])          # tf.concat([...], axis=0)
    """
    if not chunks:
        raise ValueError("merge_chunks: no chunks to merge")
    first = chunks[0]
    if isinstance(first, (tuple, list)):
        specs = chunk_spec if chunk_spec is not None else [None] * len(first)
        return type(first)(merge_chunks([c[i] for c in chunks], specs[i]) for i in range(len(first)))
    if isinstance(first, dict):
        specs = chunk_spec or {}
        return {k: merge_chunks([c[k] for c in chunks], specs.get(k)) for k in first}
    if not _is_tensor(first):
        return first
    dim = chunk_spec.split_dim if isinstance(chunk_spec, TensorChunkSpec) else 0
    return tf.concat(chunks, axis=dim)
