"""Model averagers (torch.distributed.algorithms.model_averaging.averagers) for the replicas
``tfdist.nn.parallel.DistributedDataParallel`` keeps."""

from __future__ import annotations

import abc
import warnings
from typing import Any, Iterable

import tensorflow as tf

from tfdist.algorithms.model_averaging.utils import _check_group, average_parameters_or_parameter_groups
from tfdist.nn.parallel._replicas import counter, replicas_of, run_if

__all__ = ["ModelAverager", "PeriodicModelAverager"]


class ModelAverager(abc.ABC):
    """Base class of model averagers: ``step`` counts ``average_parameters`` calls.

    The count lives on the replicas' mesh (a variable), so a traced training
    step that calls ``average_parameters`` averages on the right iterations
    without being traced again.
    """

    def __init__(self, process_group: Any = None) -> None:
        _check_group(process_group)
        self.process_group = process_group
        self._counter: Any = None
        self._initial_step = 0

    @property
    def step(self) -> int:
        """How many times ``average_parameters`` has run (torch's ``averager.step``)."""
        return self._initial_step if self._counter is None else int(self._counter.numpy())

    @step.setter
    def step(self, value: int) -> None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{type(self).__name__}.step must be a non-negative int. Received: {value!r}")
        if self._counter is None:
            self._initial_step = value
        else:
            self._counter.assign(tf.cast(value, tf.int64))

    def _step_variable(self, params: list[Any]) -> Any:
        if self._counter is None:
            found = next((replicas_of(v) for v in params if replicas_of(v) is not None), None)
            if found is None:
                raise ValueError(f"{type(self).__name__}.average_parameters: none of the parameters is a "
                                 "DistributedDataParallel replica (pass model.trainable_variables of a DDP model).")
            self._counter = counter(found[1].mesh, self._initial_step)
        return self._counter

    @abc.abstractmethod
    def average_parameters(self, params: Iterable[Any]) -> None:
        """Averages ``params`` over the replicas when this averager's schedule says so."""


class PeriodicModelAverager(ModelAverager):
    """Averages the replicas every ``period`` steps once ``warmup_steps`` have passed.

    Example::

        averager = PeriodicModelAverager(period=4, warmup_steps=100)
        for x, y in batches:
            ...; optimizer.apply(grads, model.trainable_variables)
            averager.average_parameters(model.trainable_variables)
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: Any = None) -> None:
        super().__init__(process_group)
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"PeriodicModelAverager: warmup_steps must be a non-negative int. "
                             f"Received: warmup_steps={warmup_steps!r}")
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"PeriodicModelAverager: period must be a positive int. Received: period={period!r}")
        if period == 1:
            warnings.warn("PeriodicModelAverager(period=1): averaging the parameters every step costs no less than "
                          "averaging the gradients, which DistributedDataParallel already does.", UserWarning,
                          stacklevel=2)
        self.period, self.warmup_steps = period, warmup_steps

    def average_parameters(self, params: Iterable[Any]) -> None:
        """Averages on steps ``warmup_steps, warmup_steps + period, ...``; counts the step."""
        params = list(params)
        flat = [v for p in params for v in (p["params"] if isinstance(p, dict) else [p])]
        step = self._step_variable(flat)
        now = step.read_value()
        due = tf.logical_and(now >= self.warmup_steps, (now - self.warmup_steps) % self.period == 0)
        run_if(due, lambda: average_parameters_or_parameter_groups(params, self.process_group))
        step.assign_add(tf.constant(1, tf.int64))
