"""``PostLocalSGDOptimizer`` (torch.distributed.optim.PostLocalSGDOptimizer): a Keras optimizer that
averages ``DistributedDataParallel``'s replicas with a model averager after each step."""

from __future__ import annotations

import warnings
from typing import Any, Callable

from tfdist import _registry
from tfdist.algorithms.model_averaging.averagers import ModelAverager
from tfdist.optim._step import optimizer_step

__all__ = ["PostLocalSGDOptimizer"]

_CLASSES: dict[type, type] = {}


class _Meta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _PostLocalSGDMethods)


class _PostLocalSGDMethods:
    """Added to the wrapped optimizer's class: every ``apply`` is followed by the averager."""

    @property
    def averager(self) -> ModelAverager:
        return _registry.optimizer(self).averager

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        out = super().apply(grads, trainable_variables)
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        self.averager.average_parameters(list(variables))
        return out

    def step(self, closure: Callable[[], Any] | None = None, *, grads: Any = None, variables: Any = None) -> Any:
        """One update then the averager (torch's ``step()``): ``closure`` computes and returns the
        loss and is differentiated here (Keras variables keep no ``.grad``), or ``grads`` are
        applied; to ``variables``, else those the optimizer was built on.  Returns the loss.

        Example::

            opt.step(lambda: loss_fn(y, model(x)), variables=model.trainable_variables)
        """
        return optimizer_step(self, closure, grads=grads, variables=variables)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's variables (numpy, in ``self.variables`` order) and the averager's ``step``,
        so a reload does not warm up again (torch's entry ``"step"``)."""
        return {"state": [v.numpy() for v in self.variables], "step": self.averager.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the variables (built first) and the averager's step; a missing ``"step"`` warns
        and restarts the averager at 0, as torch."""
        values = state_dict.get("state", [])
        if values and len(values) != len(self.variables):
            raise ValueError(f"PostLocalSGDOptimizer.load_state_dict: {len(values)} saved variables for "
                             f"{len(self.variables)} in this optimizer (build it on the model's variables first).")
        for variable, value in zip(self.variables, values):
            variable.assign(value)
        if "step" not in state_dict:
            warnings.warn("PostLocalSGDOptimizer.load_state_dict: no 'step' entry; the model averager's step "
                          "starts at 0.", UserWarning, stacklevel=2)
        self.averager.step = int(state_dict.get("step", 0))


class PostLocalSGDOptimizer(metaclass=_Meta):
    """Wraps a Keras optimizer: after each step it calls ``averager.average_parameters`` on the
    variables it updated (``DistributedDataParallel``'s replicas).  Returns ``optim`` itself, its
    class now also ``PostLocalSGDOptimizer`` -- usable in ``model.compile`` or a custom loop.

    Example (seed: torch's docs)::

        model = DistributedDataParallel(model, device_mesh=mesh)
        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
        model.register_comm_hook(state, post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=keras.optimizers.SGD(0.01),
                                    averager=averagers.PeriodicModelAverager(period=4, warmup_steps=100))
        model.compile(optimizer=opt, loss="mse"); model.fit(x, y, batch_size=64)
    """

    def __new__(cls, optim: Any, averager: ModelAverager) -> Any:
        if not hasattr(optim, "apply") or isinstance(optim, type):
            raise ValueError(f"PostLocalSGDOptimizer(optim) must be a Keras optimizer instance. Received: {optim!r}")
        if not isinstance(averager, ModelAverager):
            raise ValueError("PostLocalSGDOptimizer(averager) must be a model averager "
                             f"(averagers.PeriodicModelAverager). Received: {averager!r}")
        if isinstance(optim, _PostLocalSGDMethods):
            raise ValueError("PostLocalSGDOptimizer: the optimizer is already wrapped.")
        base = type(optim)
        if base not in _CLASSES:
            _CLASSES[base] = _registry.swapped_class(f"PostLocalSGD{base.__name__}", (_PostLocalSGDMethods, base), base)
        optim.__class__ = _CLASSES[base]
        _registry.optimizer(optim).averager = averager
        return optim
