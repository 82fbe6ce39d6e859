"""``tfdist.autograd`` (torch.distributed.autograd): a gradient context for ``DistributedOptimizer``.

torch records a distributed backward across RPC calls under a context id.
tfdist has no RPC: every client runs the same SPMD program, whose tape
already differentiates through every device and client.  So a context is a
``tf.GradientTape`` opened by ``context()``; ``backward(context_id, roots)``
adds the roots whose gradients the context holds (several calls accumulate,
as torch's do); ``get_gradients`` and ``DistributedOptimizer.step`` read them.

Example::

    with tfdist.autograd.context() as context_id:
        loss = loss_fn(y, model(x))
        tfdist.autograd.backward(context_id, [loss])
        optimizer.step(context_id)
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

import tensorflow as tf

__all__ = ["context", "backward", "get_gradients"]

_CONTEXTS: dict[int, "_Context"] = {}
_IDS = itertools.count(1)


class _Context:
    def __init__(self) -> None:
        self.tape = tf.GradientTape(persistent=True)
        self.roots: list[tf.Tensor] = []

    def gradients(self, sources: list[Any]) -> list[tf.Tensor | None]:
        if not self.roots:
            raise RuntimeError("tfdist.autograd: no backward pass in this context: call "
                               "tfdist.autograd.backward(context_id, [loss]) first.")
        total = tf.add_n([tf.reduce_sum(r) for r in self.roots]) if len(self.roots) > 1 else tf.reduce_sum(
            self.roots[0])
        return self.tape.gradient(total, sources)


class context:  # noqa: N801 -- torch's name
    """Opens a gradient context; ``with`` gives its id.  Its tape records the block's operations."""

    def __enter__(self) -> int:
        self.context_id = next(_IDS)
        own = _CONTEXTS[self.context_id] = _Context()
        own.tape.__enter__()
        return self.context_id

    def __exit__(self, *exc: object) -> None:
        own = _CONTEXTS.pop(self.context_id)
        own.tape.__exit__(*exc)


def _context(context_id: int) -> _Context:
    own = _CONTEXTS.get(context_id)
    if own is None:
        raise ValueError(f"tfdist.autograd: context_id {context_id!r} is not an open context "
                         f"(open: {sorted(_CONTEXTS)}); use it inside `with tfdist.autograd.context() as context_id`.")
    return own


def backward(context_id: int, roots: Iterable[tf.Tensor], retain_graph: bool = False) -> None:
    """Adds ``roots`` (scalars, or tensors whose sum is differentiated) to the context's backward;
    gradients of several calls add up.  ``retain_graph`` is accepted (the tape keeps what it needs)."""
    roots = list(roots)
    if not roots or not all(isinstance(r, tf.Tensor) or hasattr(r, "dtype") for r in roots):
        raise ValueError(f"tfdist.autograd.backward(roots) must be a non-empty list of tensors. Received: {roots!r}")
    _context(context_id).roots.extend(tf.convert_to_tensor(r) for r in roots)


def get_gradients(context_id: int) -> dict[Any, tf.Tensor]:
    """The gradients of the context's roots for every variable its tape watched, keyed by
    ``variable.ref()`` (TF variables are not hashable; torch keys by the tensor)."""
    own = _context(context_id)
    watched = list(own.tape.watched_variables())
    return {v.ref(): g for v, g in zip(watched, own.gradients(watched)) if g is not None}


def gradients_for(context_id: int, variables: list[Any]) -> list[tf.Tensor | None]:
    """The gradients of the context's roots for ``variables`` (any variable the tape can read)."""
    return _context(context_id).gradients(list(variables))
