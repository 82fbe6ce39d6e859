"""``DistributedOptimizer`` (torch.distributed.optim.DistributedOptimizer) over tfdist's gradient
contexts.

torch's takes remote references to parameters on several workers and steps
a local optimizer on each.  In tfdist every client runs the same SPMD
program and a DTensor variable lives on the devices of its mesh, whichever
clients own them: one optimizer over the variables updates each shard where
it lives.  Gradients come from a ``tfdist.autograd.context`` (torch's
``dist_autograd``), or are passed in.
"""

from __future__ import annotations

from typing import Any, Iterable

from tfdist import autograd
from tfdist.optim._step import optimizer_step

__all__ = ["DistributedOptimizer"]


def _local(param: Any) -> Any:
    """torch passes RRefs; tfdist accepts the variables (or anything with ``local_value()``)."""
    return param.local_value() if hasattr(param, "local_value") else param


class DistributedOptimizer:
    """An ``optimizer_class`` (a Keras optimizer class) over ``params_rref``, stepped from a gradient
    context.

    Example::

        opt = DistributedOptimizer(keras.optimizers.SGD, model.trainable_variables, learning_rate=0.05)
        with tfdist.autograd.context() as context_id:
            loss = loss_fn(y, model(x))
            tfdist.autograd.backward(context_id, [loss])
            opt.step(context_id)
    """

    def __init__(self, optimizer_class: type, params_rref: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        if not isinstance(optimizer_class, type) or not hasattr(optimizer_class, "apply"):
            raise ValueError("DistributedOptimizer(optimizer_class) must be a Keras optimizer class such as "
                             f"keras.optimizers.SGD. Received: {optimizer_class!r}")
        self.params = [_local(p) for p in params_rref]
        if not self.params:
            raise ValueError("DistributedOptimizer(params_rref) must list at least one parameter. Received: []")
        self.optimizer = optimizer_class(*args, **kwargs)

    def step(self, context_id: int | None = None, *, grads: list[Any] | None = None) -> None:
        """Applies the gradients of ``context_id``'s backward to the parameters (a parameter the
        backward did not reach is left), or ``grads`` given in the parameters' order."""
        if (context_id is None) == (grads is None):
            raise ValueError("DistributedOptimizer.step: pass context_id (a tfdist.autograd context) or grads. "
                             f"Received: context_id={context_id!r}, grads={'None' if grads is None else '...'}")
        if grads is None:
            grads = autograd.gradients_for(context_id, self.params)
        optimizer_step(self.optimizer, grads=grads, variables=self.params, name=type(self).__name__)
