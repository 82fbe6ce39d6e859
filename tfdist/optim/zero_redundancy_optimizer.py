"""ZeroRedundancyOptimizer (torch.distributed.optim.ZeroRedundancyOptimizer) for Keras 3.

Data parallel keeps every parameter whole on every device; this optimizer
shards its *state* (Adam's moments...) over the data-parallel mesh dim, so
each device holds 1/N of it (ZeRO stage 1).  The gradient arrives whole
(data parallel's all-reduce), each device updates the state of its shard,
and the parameter update is all-gathered back to the whole parameter.

torch partitions whole parameters among ranks and broadcasts each updated
parameter from its owner; here every state tensor is split by elements on
its first dim that divides evenly (balanced whatever the parameter sizes),
and the update is one all-gather per parameter -- the same bytes as the
broadcasts.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import keras
import numpy as np
from tensorflow.experimental import dtensor

from tfdist import _registry
from tfdist.device_mesh import DeviceMesh
from tfdist.optim._step import optimizer_step
from tfdist.tensor._modules import module_backend

__all__ = ["ZeroRedundancyOptimizer"]


def sharded_slot_layout(dp: str | None):
    """``(parameter layout, shape) -> slot layout``: ``dp`` added on the first free dim that divides."""

    def layout(param_layout: dtensor.Layout, shape: tuple[int, ...]) -> dtensor.Layout:
        mesh = param_layout.mesh
        name = dp or mesh.dim_names[0]
        specs = list(param_layout.sharding_specs)
        if name not in mesh.dim_names or name in specs:
            return param_layout
        size = mesh.dim_size(name)
        for d, n in enumerate(shape):
            if specs[d] == dtensor.UNSHARDED and n % size == 0 and n >= size:
                specs[d] = name
                return dtensor.Layout(specs, mesh)
        return param_layout  # nothing divides: this slot stays whole

    return layout


class _ZeroMethods:
    """torch's ZeroRedundancyOptimizer methods on the Keras optimizer."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Nothing to collect ahead: ``state_dict()`` reads every shard (a sharded TF DTensor
        variable reads as its whole value)."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """The whole optimizer state, by variable path (gathered)."""
        return {v.path: np.asarray(v.numpy()) for v in self.variables}

    def load_state_dict(self, state_dict: dict[str, np.ndarray]) -> None:
        """Assigns a ``state_dict()`` back (each value is laid out as its variable)."""
        own = {v.path: v for v in self.variables}
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise ValueError(f"load_state_dict: the state_dict lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
        for path, variable in own.items():
            variable.assign(state_dict[path])

    def step(self, closure: Callable[[], Any] | None = None, *, grads: Any = None, variables: Any = None) -> Any:
        """One update (torch's ``step(closure)``): ``closure`` computes and returns the loss and is
        differentiated here (Keras variables keep no ``.grad``), or ``grads`` are applied; to the
        ``params`` the optimizer was made with, else ``variables``, else those it was built on.
        Returns the closure's loss.

        Example::

            opt = ZeroRedundancyOptimizer(model.trainable_variables, keras.optimizers.Adam, learning_rate=1e-3)
            loss = opt.step(lambda: keras.losses.mean_squared_error(y, model(x)))
        """
        return optimizer_step(self, closure, grads=grads, variables=variables)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds variables to the optimizer (torch: a new param group), e.g. layers unfrozen while
        fine-tuning; their state is created sharded like the rest, the existing state is kept.

        A Keras optimizer has one value of each hyper-parameter for all its variables, so a
        group may repeat the optimizer's values but not set others.  Recompile the model after
        changing ``trainable`` (Keras traces its step with the trainable variables of the time).

        Example::

            model.layers[0].trainable = True
            opt.add_param_group({"params": model.layers[0].trainable_variables})
            model.compile(optimizer=opt, loss="mse")
        """
        new = _checked_group(self, param_group)
        if not getattr(self, "built", False):
            raise ValueError("add_param_group: the optimizer is not built yet; it takes its variables at its first "
                             "step (or optim.build(variables)), so pass these there.")
        known = {self._var_key(v) for v in self._trainable_variables}
        new = [v for v in new if self._var_key(v) not in known]
        if not new:
            return
        old_slots = {v.path: v for v in self._variables}
        indices, variables = dict(self._trainable_variables_indices), list(self._trainable_variables) + new
        self.built = False
        self._trainable_variables_indices = {}
        try:
            with _distribution_scope():
                self.build(variables)  # fresh slots for every variable, the old ones' values copied below
        except BaseException:
            self.built, self._trainable_variables_indices = True, indices  # as it was
            raise
        replaced = []
        for v in self._variables:
            previous = old_slots.get(v.path)
            if previous is not None and previous is not v:
                v.assign(previous.value)
                replaced.append(id(previous))
        self._variables = [v for v in self._variables if id(v) not in set(replaced)]


def _checked_group(optimizer: Any, param_group: Any) -> list[Any]:
    """The group's variables; hyper-parameters other than the optimizer's own values are refused."""
    if not isinstance(param_group, dict) or "params" not in param_group:
        raise ValueError("add_param_group(param_group) takes a dict with 'params' (a list of variables). "
                         f"Received: {param_group!r}")
    params = param_group["params"]
    params = [params] if hasattr(params, "assign") else list(params)
    bad = [p for p in params if not hasattr(p, "assign")]
    if bad:
        raise ValueError(f"add_param_group: 'params' must hold Keras variables. Received: {bad[0]!r}")
    config = optimizer.get_config()
    for key, value in param_group.items():
        if key == "params":
            continue
        name = "learning_rate" if key == "lr" else key
        if name not in config:
            raise ValueError(f"add_param_group: {type(optimizer).__name__} has no hyper-parameter {key!r}.")
        if not _same(config[name], value):
            raise ValueError(
                f"add_param_group: a Keras optimizer has one {name!r} for all its variables "
                f"({config[name]!r}); a group cannot set its own ({key}={value!r}).")
    return params


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(np.isclose(float(a), float(b)))
    except (TypeError, ValueError):
        return a == b


def _distribution_scope() -> contextlib.AbstractContextManager:
    """The global keras distribution's scope, under which the model's variables were made (new
    slots take their layouts there)."""
    distribution = keras.distribution.distribution()
    return distribution.scope() if distribution is not None else contextlib.nullcontext()


class ZeroRedundancyOptimizer:
    """A Keras optimizer of ``optimizer_class`` whose state is sharded over data parallel.

    Args:
        params: accepted for torch compatibility (Keras optimizers receive
            their variables when they build); may be None.
        optimizer_class: a Keras optimizer class, e.g. ``keras.optimizers.Adam``.
        process_group: must be None.
        parameters_as_bucket_view, overlap_with_ddp: accepted; no TF meaning.
        mesh: the data-parallel mesh dim's mesh (``mesh["dp"]`` or a 1-D
            mesh); None: the first dim of the parameters' mesh (the batch
            dim of ``keras.distribution.DataParallel``).
        **defaults: the optimizer's arguments (``learning_rate=...``).

    Returns an instance of ``ZeroRedundancy<Name>``, a subclass of
    ``optimizer_class``, usable in ``model.compile``.

    Example::

        opt = ZeroRedundancyOptimizer(model.trainable_variables, keras.optimizers.Adam, learning_rate=1e-3)
        model.compile(optimizer=opt, loss="mse")
    """

    def __new__(
        cls, params: Iterable[Any] | None = None, optimizer_class: type | None = None, process_group: Any = None,
        parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
        mesh: DeviceMesh | None = None, **defaults: Any,
    ) -> Any:
        if not isinstance(optimizer_class, type) or not hasattr(optimizer_class, "apply_gradients"):
            raise ValueError(
                "ZeroRedundancyOptimizer(optimizer_class=...) must be a Keras optimizer class such as "
                f"keras.optimizers.Adam. Received: {optimizer_class!r}"
            )
        if process_group is not None:
            raise ValueError(
                f"ZeroRedundancyOptimizer: process_group must be None (pass mesh). Received: {process_group!r}"
            )
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(
                f"ZeroRedundancyOptimizer(mesh=...) must be 1-D (mesh['dp']). Received: {mesh.ndim} dims"
            )
        dp = None if mesh is None else mesh.root_mesh.axis_names[mesh.root_dims[0]]
        subclass = _zero_class(optimizer_class)
        optimizer = subclass(**defaults)
        module_backend(optimizer, "ZeroRedundancyOptimizer")  # loads tfdist's Keras integration
        _registry.optimizer(optimizer).slot_layout = sharded_slot_layout(dp)
        _registry.optimizer(optimizer).params = None if params is None else list(params)
        return optimizer

    # what the returned optimizer has, at torch's paths (ZeroRedundancyOptimizer.state_dict, ...)
    consolidate_state_dict = _ZeroMethods.consolidate_state_dict
    state_dict = _ZeroMethods.state_dict
    load_state_dict = _ZeroMethods.load_state_dict
    step = _ZeroMethods.step
    add_param_group = _ZeroMethods.add_param_group


_CLASSES: dict[type, type] = {}


def _zero_class(optimizer_class: type) -> type:
    if optimizer_class not in _CLASSES:
        _CLASSES[optimizer_class] = type(
            f"ZeroRedundancy{optimizer_class.__name__}", (_ZeroMethods, optimizer_class),
            {"__module__": optimizer_class.__module__},
        )
    return _CLASSES[optimizer_class]
