"""Keras variables backed by ``dtensor.DVariable``s, and correct reads after writes.

Creation: a Keras TF variable keeps a ``tf.Variable`` in ``_value``.  When
tfdist knows a layout for a new variable -- set by ``parallelize_module`` on
its layer, by the optimizer for a slot of a sharded parameter, or by the
active ``keras.distribution`` -- the initial value (computed unsharded, so
it is the same on any mesh) is laid out and ``_value`` becomes a DVariable.

Reads after writes: on a 2-D mesh TF DTensor returns the *old* value when a
DVariable is read after its own assignment inside a ``tf.function``
(``docs/tf_dtensor_repros/dtensor_stale_read_after_write.py``), which silently
breaks Keras optimizers and metrics.  tfdist records, per traced graph, the
value last written to each DVariable and serves reads in that graph from it:
the program then reads "the value it computed", which TF DTensor gets right.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _patches, _registry
from tfdist.fsdp import FSDPStyle, _offload
from tfdist.keras._backend import _as_tf_layout, distribute_tensor, new_dvariable, tfdist_mesh
from tfdist.keras._data import gather_to_numpy
from tfdist.keras._keras_internals import KerasVariable
from tfdist.tensor._modules import module_backend
from tfdist.tensor._redistribute import relayout, relayout_traced

__all__ = [
    "is_dtensor_variable",
    "current_value",
    "record_write",
    "reads_device_copies",
    "to_dvariable",
    "layout_scope",
    "install",
]

_state = threading.local()
# graph -> {id(DVariable): latest value tensor in that graph}
_LATEST: "weakref.WeakKeyDictionary[Any, dict[int, tf.Tensor]]" = weakref.WeakKeyDictionary()


def layout_of(dvariable: dtensor.DVariable) -> dtensor.Layout:
    """A DVariable's layout, also while a tf.function is being traced."""
    layout = getattr(dvariable, "layout", None)
    if layout is not None:
        return layout
    with tf.init_scope():
        return dtensor.fetch_layout(dvariable.read_value())


def is_dtensor_variable(variable: Any) -> bool:
    inner = getattr(variable, "_value", variable)
    return isinstance(inner, dtensor.DVariable)


def _graph_cache() -> dict[int, tf.Tensor] | None:
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    cache = _LATEST.get(graph)
    if cache is None:
        cache = {}
        _LATEST[graph] = cache
    return cache


def current_value(dvariable: dtensor.DVariable) -> tf.Tensor:
    """The value of ``dvariable`` as this program last wrote it (or its device copy, or a fresh
    read), at Keras' shape."""
    cache = _graph_cache()
    if cache is not None and id(dvariable) in cache:
        return unpad(dvariable, cache[id(dvariable)])
    copy = getattr(_state, "device_copies", {}).get(id(dvariable))
    if copy is not None:
        return unpad(dvariable, copy)
    return unpad(dvariable, dvariable.read_value())


class _ThreadMap:
    """Within it (this thread), ``_state.<attr>`` maps each given object's id to its tensor, on
    top of what an enclosing block of the same kind maps."""

    attr = ""

    def __init__(self, pairs: list[tuple[Any, tf.Tensor]]) -> None:
        self.values = {id(obj): value for obj, value in pairs}

    def __enter__(self) -> None:
        self.saved = getattr(_state, self.attr, {})
        setattr(_state, self.attr, {**self.saved, **self.values})

    def __exit__(self, *exc: object) -> None:
        setattr(_state, self.attr, self.saved)


class reads_device_copies(_ThreadMap):
    """Within it (this thread), every read of one of the given DVariables gives its tensor.

    CPU offload: a parameter lives on the host mesh between steps; a step runs on the device mesh
    with a copy made before it (``tfdist.fsdp._offload``), and every read path -- a Keras
    variable's ``value``, FSDP's stored shard -- serves that copy, so the step's program never
    touches the host mesh and its gradient is taken with respect to the copy."""

    attr = "device_copies"


def has_device_copy(dvariable: Any) -> bool:
    """A ``reads_device_copies`` block of this thread serves ``dvariable``."""
    return id(dvariable) in getattr(_state, "device_copies", {})


def record_write(dvariable: dtensor.DVariable, value: tf.Tensor) -> None:
    cache = _graph_cache()
    if cache is not None:
        cache[id(dvariable)] = value


def write(dvariable: dtensor.DVariable, value: tf.Tensor) -> tf.Tensor:
    """Assigns and records, so later reads in the same graph see ``value``.

    ``value`` has Keras' shape; a padded DVariable gets it with zeros in its padding.
    """
    value = tf.cast(tf.convert_to_tensor(value), dvariable.dtype)
    if logical_shape(dvariable) is not None:
        value = _pad_to(value, tuple(dvariable.shape), value_layout(dvariable))
    if tf.executing_eagerly() and not dtensor.is_dtensor(value):
        # a host value (load_weights, set_weights, assign(numpy)): lay it out first
        value = distribute_tensor(value, layout_of(dvariable))
    elif tf.executing_eagerly() and dtensor.fetch_layout(value) != layout_of(dvariable):
        value = relayout(value, layout_of(dvariable))  # e.g. a full value written to a sharded variable
    elif not tf.executing_eagerly():
        value = relayout_traced(value, layout_of(dvariable))  # the gather TF would insert, made safe
    dvariable.assign(value)
    record_write(dvariable, value)
    return value


class variables_as_handles:
    """Within it, ``v.value`` of the given Keras variables is the DVariable itself.

    Keras' optimizer takes ``v.value`` as the variable to update (a key for its
    slots, the target of ``assign``); after an earlier write in the same step
    (weight decay) the read-after-write cache would hand it a tensor instead.
    Other variables (slots read after their writes) keep the cache.
    """

    def __init__(self, variables: Any) -> None:
        self.ids = {id(v._value) for v in variables
                    if is_dtensor_variable(v) and logical_shape(v._value) is None}

    def __enter__(self) -> None:
        self.saved = getattr(_state, "handles", frozenset())
        _state.handles = self.saved | self.ids

    def __exit__(self, *exc: object) -> None:
        _state.handles = self.saved


class reads_as(_ThreadMap):
    """Within it (this thread), reading one of the given Keras variables gives its tensor.

    FSDP runs a layer's call with its gathered (unsharded) parameters this
    way: the layer's code reads ``self.kernel`` as usual and gets the
    all-gathered value, whose gradient flows back to the sharded variable.
    Keras' ``StatelessScope`` does the same for reads but also captures
    assignments and losses, which must reach the real variables here.
    """

    attr = "substitutes"


# -- where a new variable's layout comes from -----------------------------------
class layout_scope:
    """Within it, the next variables created take ``layout`` (optimizer slots)."""

    def __init__(self, layout: dtensor.Layout | None) -> None:
        self.layout = layout

    def __enter__(self) -> None:
        stack = getattr(_state, "slot_layouts", [])
        stack.append(self.layout)
        _state.slot_layouts = stack

    def __exit__(self, *exc: object) -> None:
        _state.slot_layouts.pop()


def _current_layer() -> Any:
    stack = getattr(_state, "layers", [])
    return stack[-1] if stack else None


def _pick_layout(variable: Any) -> dtensor.Layout | None:
    slot = getattr(_state, "slot_layouts", [])
    if slot and slot[-1] is not None:
        return slot[-1]
    attached = _registry.variable_if_any(variable)
    if attached is not None and attached.layout_fn is not None:  # set by add_weight; initialised later
        return attached.layout_fn(len(variable.shape))
    layer = _current_layer()
    own = _registry.module_if_any(layer) if layer is not None else None
    pending = own.weight_layouts if own is not None else None
    if pending:
        layout_fn = pending.get(variable.name)
        if layout_fn is not None:
            return layout_fn(len(variable.shape))
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    layout = distribution.get_variable_layout(variable)
    if layout is None:
        return None
    if hasattr(layout, "for_variable"):  # a tfdist LayoutMap value: style or placements
        layout = layout.for_variable(variable, layer)
    axes = getattr(layout, "axes", None)
    if axes is not None and len(axes) != len(variable.shape):
        raise ValueError(
            f"the layout {tuple(axes)} for variable '{variable.path}' has {len(axes)} axes, but the "
            f"variable has shape {tuple(variable.shape)} (rank {len(variable.shape)}). A LayoutMap key "
            "is a full-match regex over variable paths: make it match only variables of that rank "
            "(e.g. '.*dense/kernel', not '.*' which also matches the biases), or give one axis per dim."
        )
    tf_layout = _as_tf_layout(layout)
    _gather_where_used(tf_layout, distribution, layer)
    _registry.variable(variable).laid_out_by = distribution  # a model built in its scope keeps it
    return tf_layout


def _gather_where_used(layout: dtensor.Layout, distribution: Any, layer: Any) -> None:
    """A weight sharded over the batch mesh dim is stored like FSDP and gathered where used.

    JAX's GSPMD gathers such a weight where an op needs it; TF DTensor's SPMD
    expander refuses a product whose operands shard one dim over two mesh dims
    (the batch of the input, the batch of the weight). So the layer holding
    it gathers it over the batch dim in its call and reduce-scatters its
    gradient, as ``FSDPStyle`` layers do.
    """
    batch = getattr(distribution, "batch_dim_name", None)
    if batch is None or layer is None or batch not in layout.sharding_specs:
        return
    # kept gathered from the forward to the backward, as JAX's autodiff keeps what GSPMD gathered
    # (torch's reshard_after_forward=True would gather every such weight a second time per step)
    FSDPStyle(reshard_after_forward=False).attach(
        module_backend(layer, "a layout map"), layer, tfdist_mesh(distribution.device_mesh)[batch])


# -- uneven dims: stored padded, seen at Keras' shape --------------------------------
def padded_shape(shape: tuple[int, ...], layout: dtensor.Layout) -> tuple[int, ...]:
    """``shape`` with every dim rounded up to a multiple of the mesh dim it is sharded over.

    JAX pads an uneven dim; so does tfdist: a DVariable's shards must be equal,
    so a Keras variable of shape (in, 10) laid out (None, "model") on a 4-way
    model dim is stored as (in, 12) -- three columns per device, the last two
    zero -- and every read gives Keras its (in, 10) (``torch.chunk``'s split,
    as tfdist's uneven ``Shard`` stores it).
    """
    sizes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
    return tuple(-(-n // sizes[spec]) * sizes[spec] if spec in sizes else n
                 for n, spec in zip(shape, layout.sharding_specs))


def logical_shape(dvariable: Any) -> tuple[int, ...] | None:
    """The shape Keras sees for a padded DVariable; None for one stored at its own shape."""
    state = _registry.variable_if_any(dvariable)
    return state.logical_shape if state is not None else None


def unpad(dvariable: Any, value: Any, layout: dtensor.Layout | None = None) -> Any:
    """``value`` (read from ``dvariable``, or its gradient) cut to the shape Keras sees.

    In a traced program the cut is pinned to ``layout`` (default: the storage's,
    the padded dims whole): TF DTensor's layout propagation would otherwise give
    the cut the storage's sharding of the padded dim, which it cannot split
    ("requires dimension 0 to be divisible by sharding specified in DTensorLayout").
    """
    shape = logical_shape(dvariable)
    if shape is None or tuple(value.shape) == shape:
        return value
    cut = tf.slice(value, [0] * len(shape), shape)
    if tf.executing_eagerly():
        return cut
    return relayout_traced(cut, layout or value_layout(dvariable))


def value_layout(dvariable: dtensor.DVariable) -> dtensor.Layout:
    """The layout of ``dvariable``'s value at Keras' shape: its own, with the padded dims whole."""
    layout, shape = layout_of(dvariable), logical_shape(dvariable)
    if shape is None:
        return layout
    specs = [spec if n == p else dtensor.UNSHARDED
             for spec, n, p in zip(layout.sharding_specs, shape, dvariable.shape)]
    return dtensor.Layout(specs, layout.mesh)


def _pad_to(value: Any, shape: tuple[int, ...], layout: dtensor.Layout | None = None) -> Any:
    """``value`` with zeros after its end up to ``shape``; in a traced program pinned to ``layout``
    on both sides (TF DTensor pads only "with input layout same as op output layout")."""
    value = tf.convert_to_tensor(value)
    if tuple(value.shape) == tuple(shape):
        return value
    paddings = [[0, p - n] for p, n in zip(shape, value.shape)]
    if layout is None or tf.executing_eagerly():
        return tf.pad(value, paddings)
    return dtensor.relayout(tf.pad(relayout_traced(value, layout), paddings), layout)


def make_dvariable(value: Any, layout: dtensor.Layout, **kwargs: Any) -> dtensor.DVariable:
    """A DVariable holding ``value`` on ``layout``, padded where a dim does not split evenly."""
    shape = tuple(value.shape)
    padded = padded_shape(shape, layout)
    dvariable = new_dvariable(_pad_to(value, padded), layout, **kwargs)
    if padded != shape:
        _registry.variable(dvariable).logical_shape = shape
    return dvariable


def to_dvariable(variable: Any, layout: dtensor.Layout) -> None:
    """Moves an existing Keras variable onto ``layout`` (in place)."""
    old = variable._value
    value = old.read_value() if isinstance(old, tf.Variable) else tf.convert_to_tensor(old)
    if isinstance(old, dtensor.DVariable):
        old_layout = layout_of(old)
        if old_layout == layout:
            return
        value = relayout(value, dtensor.Layout.replicated(old_layout.mesh, value.shape.rank), old_layout)
        value = unpad(old, dtensor.unpack(value)[0])
    variable._value = make_dvariable(value, layout, trainable=variable.trainable, name=variable.name)


def offload(variable: Any, device: dtensor.Layout) -> None:
    """Stores Keras ``variable`` (a DVariable on ``device``) on the host mesh, sharded alike
    (``tfdist.fsdp._offload``); its device copy takes ``device``."""
    inner = variable._value
    if logical_shape(inner) is not None:
        raise NotImplementedError(
            f"CPU offload: {variable.path} is stored padded (its shape {logical_shape(inner)} does not "
            "split evenly over its layout); offloading a padded parameter is not built. Leave it on the "
            "devices (fully_shard(..., ignored_params=[it])) or use a mesh that divides it.")
    host = _offload.host_layout(device)
    value = _offload.copy_shards(inner.read_value(), host)
    variable._value = new_dvariable(value, host, trainable=variable.trainable, name=variable.name)
    _offload.record(variable, device)


def compute_mesh(variable: Any) -> dtensor.Mesh:
    """The mesh a Keras DTensor variable's layer computes on: its own, or for an offloaded one
    (stored on the host mesh) its device copy's."""
    layout = _offload.device_layout(variable)
    return layout.mesh if layout is not None else layout_of(variable._value).mesh


def _host_cpu() -> str:
    return tf.config.list_logical_devices("CPU")[0].name


def install() -> None:
    core_ = "keras.src.backend.tensorflow.core:Variable."
    if _patches.installed(core_ + "_initialize"):
        return
    original_initialize = _patches.original(core_ + "_initialize")
    original_direct_assign = _patches.original(core_ + "_direct_assign")

    def _initialize(self, value):
        if isinstance(value, tf.Variable):
            return original_initialize(self, value)
        if not callable(value) and getattr(self, "_shape", None) is None:
            # a variable given a value (not an initializer) learns its shape from it; no
            # conversion here: inside a traced step it would make a graph constant that the
            # eager initialisation below cannot use (Adafactor's build does this)
            self._shape = tuple(value.shape) if hasattr(value, "shape") else tuple(np.shape(value))
        if isinstance(value, tf.Tensor) and not tf.executing_eagerly():
            # a constant Keras made inside the traced step (Nadam's, Adafactor's slots):
            # its value, so the eager initialisation below can use it
            static = tf.get_static_value(value)
            value = static if static is not None else value
        layout = _pick_layout(self)
        if layout is None:
            return original_initialize(self, value)
        # Variables may be created while a step is traced (optimizer slots):
        # their initial value must be made eagerly.
        # On this client's CPU: Keras' TF optimizer makes slots under colocate_vars_with(the
        # parameter), the DTensor device, where an initializer's (and the padding's) op would land on
        # TF DTensor's default mesh -- another model's, or, with sub-meshes of other clients, a remote
        # one whose tensors hold no value. make_dvariable moves the host value onto its layout.
        with tf.init_scope(), tf.device(_host_cpu()):
            if callable(value):
                value = value()
            value = tf.cast(tf.convert_to_tensor(value), self._dtype)
            self._value = make_dvariable(value, layout, trainable=self.trainable, name=self.name)

    def _direct_assign(self, value):
        if isinstance(self._value, dtensor.DVariable):
            write(self._value, value)
        else:
            original_direct_assign(self, value)

    base_value = KerasVariable.value.fget

    def value(self):
        inner = self.__dict__.get("_value")
        substitute = getattr(_state, "substitutes", {}).get(id(self))
        if substitute is not None:  # FSDP: the gathered parameter, inside its layer's call
            # gathered for this call: its cut is pinned whole (a padded dim rarely meets FSDP)
            whole = None if logical_shape(inner) is None else dtensor.Layout.replicated(
                layout_of(inner).mesh, len(self.shape))
            return self._maybe_autocast(unpad(inner, substitute, whole))
        if isinstance(inner, dtensor.DVariable) and id(inner) not in getattr(_state, "handles", ()):
            cache = _graph_cache()
            if cache is not None and id(inner) in cache:
                return self._maybe_autocast(unpad(inner, cache[id(inner)]))
            if has_device_copy(inner):  # CPU offload: the step's device copy
                return self._maybe_autocast(current_value(inner))
            if logical_shape(inner) is not None:  # stored padded: every read is cut to Keras' shape
                return self._maybe_autocast(unpad(inner, inner.read_value()))
        return base_value(self)

    def handle(self):
        return self._value.handle

    original_numpy = _patches.original(core_ + "numpy")
    original_array = KerasVariable.__array__

    def numpy(self):
        if isinstance(self._value, dtensor.DVariable):
            return gather_to_numpy(unpad(self._value, self._value.read_value()))
        return original_numpy(self)

    def __array__(self, dtype=None, *args, **kwargs):
        if isinstance(self._value, dtensor.DVariable):
            out = numpy(self)
            return out.astype(dtype) if dtype is not None else out
        return original_array(self, dtype, *args, **kwargs)

    original_add_weight = _patches.original("keras.src.layers.layer:Layer.add_weight")

    def add_weight(self, *args, **kwargs):
        # lets the creation hook see which layer a new weight belongs to
        stack = getattr(_state, "layers", [])
        stack.append(self)
        _state.layers = stack
        try:
            variable = original_add_weight(self, *args, **kwargs)
        finally:
            stack.pop()
        own = _registry.module_if_any(self)
        pending = own.weight_layouts if own is not None else None
        if pending and getattr(variable, "_value", None) is None and variable.name in pending:
            # built in a stateless scope: initialised later, outside add_weight
            _registry.variable(variable).layout_fn = pending[variable.name]
        return variable

    _patches.install(core_ + "_initialize", _initialize)
    _patches.install(core_ + "_direct_assign", _direct_assign)
    _patches.install(core_ + "value", property(value))
    _patches.install(core_ + "handle", property(handle))
    _patches.install(core_ + "numpy", numpy)
    _patches.install(core_ + "__array__", __array__)
    _patches.install("keras.src.layers.layer:Layer.add_weight", add_weight)
