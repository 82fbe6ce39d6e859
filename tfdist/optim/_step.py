"""torch's ``optimizer.step(closure=None)`` for a Keras optimizer.

torch reads the gradients ``loss.backward()`` left on each parameter's ``.grad``; Keras variables
keep none.  So ``step`` takes what produces them: ``closure`` (torch's own argument: a function
that computes and returns the loss) is run under a ``tf.GradientTape`` and differentiated with
respect to the optimizer's variables, or ``grads`` computed by the caller are applied as they are.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfdist import _registry

__all__ = ["optimizer_step"]


def _variables_of(optimizer: Any, variables: Any, name: str) -> list:
    if variables is not None:
        return list(variables)
    given = getattr(_registry.optimizer_if_any(optimizer), "params", None)
    if given:
        return list(given)
    built = list(getattr(optimizer, "_trainable_variables", None) or [])
    if not built:
        raise ValueError(f"{name}.step: the optimizer has no variables yet; pass "
                         "variables=model.trainable_variables (or build it on them). Received: variables=None")
    return built


def optimizer_step(optimizer: Any, closure: Callable[[], Any] | None = None, *, grads: Any = None,
                   variables: Any = None, name: str | None = None) -> Any:
    """One update of ``optimizer``; returns the closure's loss (None without a closure).
    ``name``: the class the user called ``step`` on, for messages (default: the optimizer's)."""
    name = name or type(optimizer).__name__
    if (closure is None) == (grads is None):
        raise ValueError(f"{name}.step: pass closure (a function returning the loss) or "
                         f"grads. Received: closure={closure!r}, grads={'None' if grads is None else '...'}")
    targets = _variables_of(optimizer, variables, name)
    loss = None
    if closure is not None:
        if not callable(closure):
            raise TypeError(f"{name}.step(closure): closure must be callable. "
                            f"Received: {closure!r}")
        with tf.GradientTape() as tape:
            loss = closure()
        grads = tape.gradient(loss, targets)
    grads = list(grads)
    if len(grads) != len(targets):
        raise ValueError(f"{name}.step: {len(grads)} gradients for {len(targets)} variables.")
    pairs = [(g, v) for g, v in zip(grads, targets) if g is not None]  # a variable the loss misses: left
    optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
    return loss
