"""Keras ``jit_compile=True`` on a CPU or GPU mesh: the model's forward as one XLA program per device.

On one device ``jit_compile=True`` makes Keras' TF backend compile the step with XLA.  On a mesh
TF DTensor takes a jit-compiled function apart before it expands the step (docs/design.md, "XLA for
the per-device programs"), so tfdist compiles each device's share itself where that share is known
without TF DTensor's expansion: a data-parallel model.  Every variable is replicated and the batch
is split over the batch dim, so each device's forward is the model's own forward on its rows.  While
tfdist traces a step program of such a model, the model's top-level call
(``self(x, training=...)`` in Keras' or the user's ``train_step``, ``test_step``, ``predict_step``)
runs as ``model.stateless_call`` inside one XLA program per device (``compiled_per_device``: an
``XlaCallModule`` of its StableHLO).  Its gradient is another per-device XLA program, and the
data-parallel reduction of the gradients stays TF DTensor's all-reduce.  The loss, the metrics and
the optimizer run as TF ops, as before.

A forward stays per device only where it is per example.  tfdist runs it as TF ops (and, for an
explicit ``jit_compile=True``, says why once) where:

- a variable is sharded (a layout map or plan: the devices' shares need TF DTensor's collectives),
  or the model has parameters offloaded to the host;
- the forward updates a non-trainable variable (batch normalisation's statistics, a random layer's
  seed: on one device they see the whole batch) or adds losses (``add_loss``);
- an input or output has no static batch dim, or an output has no batch dim;
- XLA cannot compile the forward or its gradient (an op without an XLA kernel, a shape known
  only at run time; on one device Keras' step would fail there, on a mesh it runs as TF ops, said).

Where XLA pays: on GPUs, whose per-op launches it fuses (Keras' ``"auto"`` picks XLA when the host
has an accelerator, the same on a mesh).  On CPUs Keras' ``"auto"`` keeps TF ops, and that is what
is faster there: keras-hub's Gemma step, data parallel on 8 virtual CPUs, takes 1.5x as long
compiled per device as with TF's oneDNN kernels (benchmarks/per_device_xla.py, docs/performance.md).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.keras import _offload_step, _variables
from tfdist.keras._keras_internals import global_state
from tfdist.tensor._api import DTensor
from tfdist.tensor._layout import DTensorSpec
from tfdist.tensor._xla_local import NotCompilable, xla_platform
from tfdist.tensor.experimental._local_map import compiled_per_device
from tfdist.tensor.parallel.style import batch_replicated
from tfdist.tensor.placement_types import Replicate, Shard

__all__ = ["plan", "routes", "call"]


class _NotPerDevice(Exception):
    """The forward cannot run per device; the message says why (and it then runs as TF ops)."""


_STATE = threading.local()  # .route: the _Route of the step program this thread is tracing
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _warn_once(model: Any, reason: str) -> None:
    if model in _WARNED:
        return
    _WARNED.add(model)
    warnings.warn(
        f"jit_compile=True: model '{model.name}' trains on a mesh, where tfdist compiles each device's "
        f"forward with XLA only for a per-example forward of a data-parallel model; here {reason}, so "
        "the step runs as TF ops on every device, as with jit_compile=False.", UserWarning, stacklevel=5)


def _replicated(variable: Any) -> bool:
    if not _variables.is_dtensor_variable(variable):
        return True
    layout = _variables.layout_of(variable._value)
    return all(spec == dtensor.UNSHARDED for spec in layout.sharding_specs)


def why_not(model: Any, mesh: DeviceMesh, batch_axis: int | None) -> str | None:
    """Why ``model``'s forward cannot be compiled per device on ``mesh`` (None: it can)."""
    if batch_axis is None:
        return "its distribution names no batch dim, so no device holds rows of its own"
    sharded = [v.path for v in model.variables if not _replicated(v)]
    if sharded:
        return (f"variables {sharded[:3]}{' ...' if len(sharded) > 3 else ''} are sharded over the mesh "
                "(each device's share of the forward needs TF DTensor's collectives)")
    if _offload_step.offloaded_variables(model):
        return "some of its parameters are offloaded to the host"
    return None


def plan(model: Any, mesh: DeviceMesh, batch_axis: int | None) -> Callable[[], Any] | None:
    """The scope a step program of ``model`` is traced inside so that its forward is compiled
    per device, or None: ``jit_compile`` off, a TPU mesh (TF DTensor compiles the whole step
    with XLA there), or a model whose forward is not per device (``why_not``; said once)."""
    if not getattr(model, "jit_compile", False) or xla_platform(mesh.device_type) is None:
        return None
    reason = why_not(model, mesh, batch_axis)
    if reason is not None:
        _warn_once(model, reason)
        return None
    route = _Route(model, mesh, batch_axis)

    @contextlib.contextmanager
    def routing():
        previous = getattr(_STATE, "route", None)
        _STATE.route = route
        try:
            yield
        finally:
            _STATE.route = previous

    return routing


def routes(layer: Any) -> bool:
    """Whether this call of ``layer`` is the top-level call of a model whose step this thread is
    tracing with a per-device forward (checked on every Layer.__call__: one attribute read)."""
    route = getattr(_STATE, "route", None)
    return route is not None and route.model is layer and not route.inside and route.enabled


def call(layer: Any, original: Callable, args: tuple, kwargs: dict) -> Any:
    """``layer(*args, **kwargs)`` with its forward compiled per device, or as TF ops where it is
    not per device (``_NotPerDevice``)."""
    route = _STATE.route
    try:
        return route.forward(args, kwargs)
    except _NotPerDevice as why:
        route.enabled = False  # the other programs of this fit too: one answer per model
        _warn_once(layer, str(why))
        return original(layer, *args, **kwargs)


@contextlib.contextmanager
def _without_distribution():
    """Inside a device's program: Keras' plain TF layers (no layouts to apply, local tensors)."""
    saved = global_state.get_global_attribute("distribution")
    global_state.set_global_attribute("distribution", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("distribution", saved)


class _Route:
    """One model's per-device forward: its compiled programs, by input signature."""

    def __init__(self, model: Any, mesh: DeviceMesh, batch_axis: int) -> None:
        self.model = model
        self.mesh = mesh
        self.batch_axis = batch_axis
        self.inside = False
        self.enabled = True
        self.programs: dict = {}

    def _batch_placements(self) -> tuple:
        if batch_replicated():  # a partial batch: every device computes it whole
            return (Replicate(),) * self.mesh.ndim
        return tuple(Shard(0) if m == self.batch_axis else Replicate() for m in range(self.mesh.ndim))

    def forward(self, args: tuple, kwargs: dict) -> Any:
        if len(args) != 1 or any(isinstance(v, (tf.Tensor, tf.Variable)) for v in tf.nest.flatten(kwargs)):
            raise _NotPerDevice("its call takes tensors other than its inputs")
        x = args[0]
        leaves = tf.nest.flatten(x)
        placements = self._batch_placements()
        split = self.mesh.shape[self.batch_axis] if placements[self.batch_axis] != Replicate() else 1
        if not all(isinstance(t, tf.Tensor) and t.shape.rank and t.shape.is_fully_defined()
                   and t.shape[0] % split == 0 for t in leaves):
            raise _NotPerDevice("an input has no static batch dim in this program")
        model = self.model
        trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
        n_x, n_t = len(leaves), len(trainable)

        def dt(value: tf.Tensor, places: tuple) -> DTensor:
            return DTensor._wrap(value, DTensorSpec(self.mesh, places, tuple(value.shape.as_list())))

        replicated = (Replicate(),) * self.mesh.ndim
        inputs = [dt(t, placements) for t in leaves] + [
            dt(v.value, replicated) for v in list(trainable) + list(non_trainable)]

        def local(*flat: tf.Tensor) -> Any:
            state = list(flat[n_x + n_t:])
            self.inside = True
            try:
                with _without_distribution():
                    out, new_state, losses = model.stateless_call(
                        list(flat[n_x:n_x + n_t]), state, tf.nest.pack_sequence_as(x, list(flat[:n_x])),
                        return_losses=True, **kwargs)
            finally:
                self.inside = False
            changed = [v.path for v, old, new in zip(non_trainable, state, new_state) if new is not old]
            if changed:
                raise _NotPerDevice(
                    f"its forward updates non-trainable variables {changed[:3]} (batch statistics or a "
                    "random layer's seed, which on one device see the whole batch)")
            if losses:
                raise _NotPerDevice("its forward adds losses (add_loss or activity regularizers)")
            if not all(isinstance(o, tf.Tensor) and o.shape.rank for o in tf.nest.flatten(out)):
                raise _NotPerDevice("an output has no batch dim")
            return out

        try:
            key = tuple(sorted(kwargs.items()))
            programs = self.programs.setdefault(key, {})  # one traced forward per call's options
        except TypeError:
            programs = {}
        try:
            results = compiled_per_device(local, inputs, placements, self.mesh, programs,
                                          with_gradient=bool(kwargs.get("training")))
        except NotCompilable as error:
            raise _NotPerDevice(str(error).replace("jit_compile=True: ", "")) from None
        return tf.nest.map_structure(lambda r: r._physical, results)
