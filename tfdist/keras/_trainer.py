"""model.fit / evaluate / predict for models whose variables are DVariables.

Keras' TF trainer pulls batches inside a ``tf.function`` (``IteratorGetNext``),
which TF DTensor cannot lay out (tf_keras fails the same way unless fed a
``DTensorDataset``).  For distributed models tfdist feeds the epoch's ``tf.data``
pipeline through ``_data.BatchFeed`` -- so numpy arrays, ``tf.data.Dataset``s and
Python generators all work: tf.data splits each batch by data-parallel coordinate
ahead of the step, the loop packs the pieces onto the mesh and runs only the step
itself as a ``tf.function``.  Everything else of Keras' loop
(callbacks, progress bar, History, validation, class/sample weights) is
unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _patches, _registry, _runtime
from tfdist.device_mesh import DeviceMesh
from tfdist.keras import _compiled_forward, _data, _offload_step, _variables
from tfdist.keras._backend import tfdist_mesh, traced_like_keras
from tfdist.keras._loss_reduction import mean_loss_reduction
from tfdist.tensor import _legalize, _step_checks
from tfdist.tensor.parallel.loss import loss_parallel
from tfdist.tensor.parallel.style import replicated_batch

__all__ = ["install", "mesh_of", "check_layout_map", "is_distributed"]


def _in_model_distribution(model, run):
    """``run`` inside the distribution ``model``'s variables were laid out by, where no other is
    active (a model built in ``distribution.scope()``, fit outside it): Keras' and tfdist's
    traced code asks ``keras.distribution.distribution()`` and must get the model's."""
    if _registry.distribution_of(model) is not None or keras.distribution.distribution() is not None:
        return run
    distribution = distribution_of(model)
    if distribution is None:
        return run

    def scoped(*args, **kwargs):
        with distribution.scope():
            return run(*args, **kwargs)

    scoped.__dict__.update(getattr(run, "__dict__", {}))
    return scoped


def distribution_of(model):
    """The model's own distribution (parallelize_module gives one), else the global one, else the
    one its variables were laid out by: a model built inside ``distribution.scope()`` and compiled
    or fit outside it (keras-hub's documented usage) splits its batches as it did inside."""
    own = _registry.distribution_of(model) or keras.distribution.distribution()
    if own is not None:
        return own
    for variable in model.variables:
        state = _registry.variable_if_any(variable)
        if state is not None and state.laid_out_by is not None:
            return state.laid_out_by
    return None


def mesh_of(model):
    """(root tfdist DeviceMesh, batch mesh dim index or None) of a distributed model."""
    distribution = distribution_of(model)
    tf_mesh = next(  # an offloaded parameter lives on the host mesh; its steps on its device copy's
        (_variables.compute_mesh(v) for v in model.variables if _variables.is_dtensor_variable(v)),
        None,
    )
    if distribution is not None:
        dist_mesh = tfdist_mesh(distribution.device_mesh)
        if tf_mesh is not None and dist_mesh.to_tf() != tf_mesh:
            raise ValueError(
                "the active keras distribution uses another mesh than the model's "
                "variables; create the model under the distribution it trains with."
            )
        mesh = dist_mesh
    elif tf_mesh is not None:
        mesh = DeviceMesh.from_tf(tf_mesh)
    else:
        return None, None
    name = getattr(distribution, "batch_dim_name", None) if distribution is not None else None
    own = _registry.module_if_any(model)
    name = name or (own.batch_dim if own is not None else None)
    if name is not None and name not in mesh.axis_names:
        raise ValueError(
            f"batch_dim_name {name!r} is not a dim of the mesh {mesh.axis_names}, so batches would "
            "not be split and training would silently run without data parallelism. "
            f"Received: batch_dim_name={name!r}; use one of {list(mesh.axis_names)}."
        )
    batch_axis = mesh.axis_names.index(name) if name is not None else None
    return mesh, batch_axis


_LAYOUT_MAPS_CHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def check_layout_map(model) -> None:
    """A LayoutMap key that matches no variable and no layer output is reported once per model.

    Keras ignores such keys, and libraries' maps carry keys for optional
    layers (keras-hub's Qwen3-MoE map names dense FFN kernels an all-MoE
    config lacks): a warning naming them, an error for a
    ``tfdist.keras.LayoutMap(..., strict=True)``.
    """
    distribution = distribution_of(model)
    layout_map = getattr(distribution, "_layout_map", None)
    if layout_map is None or model in _LAYOUT_MAPS_CHECKED:
        return
    _LAYOUT_MAPS_CHECKED.add(model)
    paths = [v.path for v in model.variables]
    # Keras looks up "<layer path>/output" for every layer call (activation layouts)
    paths += [f"{layer.path}/output" for layer in model._flatten_layers(include_self=True)
              if getattr(layer, "path", None)]
    unused = [k for k in layout_map if k not in paths and not any(re.fullmatch(k, p) for p in paths)]
    if not unused:
        return
    message = (
        f"LayoutMap keys {unused} match no variable and no layer output of the model "
        f"{model.name!r}; what they describe is not applied. The model's variable and layer output paths are: "
        f"{paths[:12]}{' ...' if len(paths) > 12 else ''}."
    )
    if getattr(layout_map, "strict", False):
        raise ValueError(message + " (the LayoutMap was made with strict=True)")
    warnings.warn(message, UserWarning, stacklevel=3)


def is_distributed(model) -> bool:
    """Variables on a mesh, or (no variables yet) a keras distribution that will put them there."""
    variables = model.variables
    if variables:
        return any(_variables.is_dtensor_variable(v) for v in variables)
    return distribution_of(model) is not None


def _explain_stranded(model, function):
    """``function`` (Keras' own step) with TF DTensor's failure for a model whose variables were
    made before ``keras.distribution.set_distribution`` turned into a clear error."""

    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (tf.errors.UnknownError, tf.errors.InvalidArgumentError) as error:
            distribution = keras.distribution.distribution()
            if distribution is None or "_element_layouts" not in str(error):
                raise
            raise ValueError(
                f"keras.distribution.set_distribution({type(distribution).__name__}(...)) came after "
                f"{model.name!r} created its variables, so they are not on the distribution's mesh "
                "(TF DTensor then fails on the input pipeline: IteratorGetNext ... _element_layouts). "
                "Set the distribution first and then build and compile the model, or pass the built "
                "model to tfdist.tensor.parallel.parallelize_module / tfdist.fsdp.fully_shard, which "
                "move existing variables onto a mesh."
            ) from None

    return run


def _loss_parallel(function):
    """``function`` run inside ``loss_parallel()``: a distributed model's sparse cross-entropy is
    always the class-shard-friendly form (``_tracing_scope``).  For ``run_eagerly``, where every
    call computes the loss anew; traced steps enter it only while tracing (``_through_concrete``)."""

    def run(*args):
        with loss_parallel():
            return function(*args)

    run.__wrapped__ = function
    return run


class _Unkeyed(Exception):
    """A batch holds a value ``_signature`` does not key (a composite tensor, an array)."""


def _signature(data) -> Any:
    """A hashable key of ``data``'s structure, shapes and dtypes (the layouts of the batches a
    step gets are fixed by its mesh, batch dim and even/partial split)."""
    if isinstance(data, dict):
        return tuple((k, _signature(v)) for k, v in sorted(data.items()))
    if isinstance(data, (list, tuple)):
        return type(data), tuple(_signature(v) for v in data)
    if isinstance(data, tf.Tensor):
        return tuple(data.shape), data.dtype
    if data is None or isinstance(data, (bool, int, float, str)):
        return type(data), data
    raise _Unkeyed


def _flat_caller(program, data):
    """``program`` (a concrete function) as a call on ``data``'s tensors, flattened.

    ``ConcreteFunction.__call__`` binds its arguments to the traced signature
    (``inspect``-style binding, then ``unpack_inputs``) and re-flattens the captured variable
    handles on every call: 0.16 ms of the main thread per W1 step of benchmarks/compare.py.
    For a batch signature both are fixed, so they are checked once here -- the flattened
    ``data`` must be, tensor for tensor, what TensorFlow's own binding hands the program --
    and each step calls ``_call_flat`` (the call ``__call__`` ends in, and the one
    ``_host_tensors`` already hooks) with them.  Where the check fails, or captures are
    resolved per call (``capture_call_time_value``), the step goes through ``__call__``."""
    from tensorflow.python.eager.polymorphic_function import function_type_utils

    bound = function_type_utils.canonicalize_function_inputs((data,), {}, program.function_type)
    expected = program.function_type.unpack_inputs(bound)
    flat = _tensors_of(data)
    same = len(expected) == len(flat) and all(a is b for a, b in zip(expected, flat))
    if not same or any(callable(c) for c in program._captured_inputs):
        return program
    captured = program.captured_inputs

    def call(data):
        return program._call_flat(_tensors_of(data), captured)

    return call


def _tensors_of(data) -> list:
    return [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]


def _program_options(mesh) -> Any:
    """What a distributed step program is called inside: on a CPU mesh, Grappler's arithmetic
    optimizer alone.

    A step on a mesh is one function that TF DTensor expands into a program per device; TF then
    runs Grappler (``tensorflow/core/grappler/optimizers/meta_optimizer.cc``) over the whole
    expanded program, once per program, when it is first called. On CPUs its default passes are
    time without a return: keras-hub's Gemma on a 2x4 mesh of virtual CPUs takes 4.4 s less to
    its first step without them (13.0 against 17.4 s) and its step is not slower. One pass pays:
    the arithmetic optimizer rewrites ``Pow(x, 3)`` (the approximate GELU of Gemma, GPT-2 and
    most keras-hub families) into ``x * Square(x)``, where TF's CPU kernel computes a generic
    ``pow`` at 30x a multiplication's cost; a named list in ``rewrite_options.optimizers`` runs
    only the passes named (``MetaOptimizer::InitializeOptimizersByName``). Numbers in
    docs/performance.md. On GPUs and TPUs Grappler's layout and fusion passes pay, so they keep
    its defaults. The option travels with the call (``FunctionCallOptions``, read when a
    function is first instantiated; every call of a program passes the same one so TF never
    instantiates it twice); plain TF code in the process keeps its own options."""
    if mesh is None or mesh.device_type.upper() != "CPU":
        return contextlib.nullcontext
    from tensorflow.python.eager import context

    config = context.context().config
    config.allow_soft_placement = True  # what TF's default call options set for functions
    rewrite = config.graph_options.rewrite_options
    rewrite.disable_meta_optimizer = False
    del rewrite.optimizers[:]
    rewrite.optimizers.append("arithmetic")
    options = context.FunctionCallOptions(config_proto=config)

    @contextlib.contextmanager
    def calling():
        ctx = context.context()
        saved = ctx.function_call_options
        ctx.function_call_options = options
        try:
            yield
        finally:
            ctx.function_call_options = saved

    return calling


def _through_concrete(function, tracing=contextlib.nullcontext, calling=contextlib.nullcontext,
                      combine: bool = False):
    """``function`` (a ``tf.function`` of one batch) called through the concrete function
    traced for each batch signature, on its flat tensors (``_flat_caller``).
    ``tf.function``'s own per-call lookup matches the DTensor arguments' trace types against
    its cache, which costs the main thread 0.3 ms per step (W1 and W2 of
    benchmarks/compare.py, 1.3 against 1.0 ms of dispatch CPU); a dict lookup on shapes does
    not.  A new signature goes through ``function`` once, which traces or relaxes as usual,
    inside ``tracing()`` (``loss_parallel``: what the traced program computes is fixed then,
    so a traced program's call does not enter it again).  ``combine``: TF DTensor combines
    the independent all-reduces of each program (``_combining``)."""
    concrete: dict = {}
    unkeyed = _combining(function) if combine else function
    legalizer = _legalize.Legalizer(function)

    def first_call(function, data):
        """A new signature's program: traced, then called once (where TF DTensor expands it)."""
        with tracing():
            program = _flat_caller(function.get_concrete_function(data), data)
            program = _combining(program) if combine else program
        with calling():
            return program, program(data)

    def call(data):
        try:
            key = _signature(data)
        except _Unkeyed:
            with tracing():
                return unkeyed(data)
        program = concrete.get(key)
        if program is None:
            program, outputs = legalizer.run(lambda function: first_call(function, data), args=data)
            concrete[key] = program
            return outputs
        with calling():
            return program(data)

    call.__wrapped__ = function
    call.programs = concrete  # batch signature -> how its step is called (for inspection)
    return call


# what TF DTensor says of a combined all-reduce a program returns
# (docs/tf_dtensor_repros/combined_all_reduce_returned_without_layout.py)
_UNCOMBINABLE = "missing result layout attribute"


# What combining trades, measured on 8 virtual CPUs (docs/design.md, "TF DTensor's all-reduce
# combining"): each all-reduce a step saves costs a fixed ~0.35 ms; packing costs the copies of
# every gradient into the buffer, ~1.2 ms per MB held per device (W1's 8.4 MB data-parallel
# gradients, 4 all-reduces: 1.2-1.4x slower combined; W2's GPT, 0.45 MB in 37: 0.85x).
_ALL_REDUCE_MS = 0.35
_PACKING_MS_PER_MB = 1.2


def combining_pays(model: Any) -> bool:
    """Whether packing ``model``'s gradient reductions into one all-reduce saves more than the
    packing costs: one reduction per trainable variable, against the bytes each device holds of
    them (a variable's shard, by its layout)."""
    variables = [v for v in model.trainable_variables if _variables.is_dtensor_variable(v)]
    held = 0
    for variable in variables:
        layout = _variables.layout_of(variable._value)
        shards = int(np.prod([layout.mesh.dim_size(d) for d in layout.sharding_specs if d != dtensor.UNSHARDED]))
        held += int(np.prod(variable.shape)) * variable._value.dtype.size // max(shards, 1)
    return _ALL_REDUCE_MS * (len(variables) - 1) > _PACKING_MS_PER_MB * held / 2**20


def _combining(run):
    """``run(data)`` with TF DTensor's all-reduce combining on while it expands a program
    (``_runtime.combined_all_reduces``): a train step's replicated gradients leave in one
    all-reduce instead of one each (W2 of benchmarks/compare.py: 50 all-reduces per device
    per step become 13).  TF refuses to combine a program that returns an all-reduced value
    -- it fails to compile, before anything runs -- and such a program is expanded again
    uncombined, once, and from then on called without combining."""
    combine = [True]

    def call(data):
        if combine[0]:
            try:
                with _runtime.combined_all_reduces():
                    return run(data)
            except tf.errors.UnknownError as error:
                if _UNCOMBINABLE not in str(error):
                    raise
                combine[0] = False
        return run(data)

    return call


@contextlib.contextmanager
def _tracing_scope():
    """What a distributed step program is traced inside: Keras' mean loss reduction as one
    mean, and ``loss_parallel()``: on a mesh, sparse cross-entropy is always computed in the form
    that reduces a sharded class dim without gathering it.

    One rule for every model, because whether the logits' class dim is sharded is decided by
    TF DTensor's layout propagation after tracing (a layout map's tied embedding, a plan's
    head), and TF DTensor's own kernel is wrong on float64 class-sharded logits: its one-hot
    of the labels is built with ``GetFPConstOfType``, a float attribute of the logits' element
    type (``softmax_spmd_expander.cc``), and the loss comes out 0
    (docs/tf_dtensor_repros/float64_sparse_ce_on_class_sharded_logits.py).  On replicated
    logits the two forms compute the same values."""
    with mean_loss_reduction(), loss_parallel():
        yield


def _tracing_scope_for(model, mesh, batch_axis):
    """What ``model``'s step programs are traced inside: ``_tracing_scope``, and, for
    ``jit_compile=True`` (or Keras' ``"auto"`` resolved to it: a host with an accelerator), the
    model's forward compiled per device where it is per device (``_compiled_forward``)."""
    routing = _compiled_forward.plan(model, mesh, batch_axis)
    if routing is None:
        return _tracing_scope

    @contextlib.contextmanager
    def scope():
        with _tracing_scope(), routing():
            yield

    return scope


def _by_batch_split(step_function, run_eagerly: bool, mesh, batch_axis, combine: bool = False,
                    tracing=_tracing_scope):
    """``step_function`` on sharded batches; a batch that does not split evenly over the
    data-parallel dim runs replicated (``replicated_batch``) in its own traced function.
    ``combine``: its programs' independent all-reduces are combined (``_combining``);
    ``tracing``: the scope its programs are traced inside (``_tracing_scope_for``).

    The even steps may relax their batch dim (``reduce_retracing``); the partial
    ones keep a static size, so a partial batch never meets a program traced for
    sharded batches.  Traced steps reduce a mean loss as one mean
    (``_loss_reduction``: the gradients' combined all-reduce stays aligned).
    """
    if run_eagerly:
        traced = None  # nothing is traced: the step runs op by op
        even, partial = _loss_parallel(step_function), _loss_parallel(step_function)
    else:
        calling = _program_options(mesh)
        checked = _step_checks.checked_step(step_function), _step_checks.checked_step(step_function)
        traced = traced_like_keras(checked[0], reduce_retracing=True), traced_like_keras(checked[1])
        even, partial = (_checks_raised(_through_concrete(f, tracing, calling, combine), c)
                         for f, c in zip(traced, checked))

    def step(data, splits_evenly=None):
        """One step on ``data``: host batches, or batches ``BatchFeed`` placed (then pass
        ``splits_evenly``, which it reports)."""
        if splits_evenly is None:
            splits_evenly = _data.splits_evenly(data, mesh, batch_axis)
            data = _data.shard_batch(data, mesh, batch_axis)
        if splits_evenly:
            return even(data)
        with replicated_batch():
            return partial(data)

    step.traced = traced  # the step programs, for inspection (tests compare their graphs)
    return step


def _checks_raised(call, checked):
    """``call(data)`` of a ``checked_step`` program: its outputs, after raising the first index
    check that failed in it (``tensor/_step_checks.py``: an id outside its table, a label outside
    its classes -- TF's kernel error on one device, zeros or NaN on a mesh without the check)."""

    def run(data):
        outputs, extremes = call(data)
        if extremes is not None:
            checked.checks.raise_failed(_data.gather_to_numpy(extremes))
        return outputs

    run.__wrapped__ = call
    run.programs = getattr(call, "programs", None)
    return run


def _steps(model, step_function, mesh, batch_axis, combine: bool = False):
    """``step(data, splits_evenly=None)`` running ``step_function``: as a program on the mesh, or,
    for a model with parameters offloaded to the host mesh, around such a program
    (``_offload_step``).  ``combine``: the program's independent all-reduces are combined
    (train and test steps; not predict's, whose outputs may be all-reduced values, nor an
    offloaded step's device program, which returns its gradients)."""
    tracing = _tracing_scope_for(model, mesh, batch_axis)

    def split(function, combine=combine):
        return _by_batch_split(function, model.run_eagerly, mesh, batch_axis, combine, tracing)

    if _offload_step.offloaded_variables(model):
        return _offload_step.offloaded_steps(model, step_function, split, mesh, batch_axis)
    return split(step_function)


def install() -> None:
    trainer = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer."
    if _patches.installed(trainer + "_make_function"):
        return
    original_make = _patches.original(trainer + "_make_function")
    original_predict = _patches.original(trainer + "make_predict_function")

    def _make_function(self, step_function):
        if not is_distributed(self):
            return _explain_stranded(self, original_make(self, step_function))
        check_layout_map(self)
        mesh, batch_axis = mesh_of(self)
        one_step = _steps(self, step_function, mesh, batch_axis, combine=combining_pays(self))
        feeds = {}  # the feed of the epoch iterator Keras passes (one, reused while Keras reuses it)

        def function(iterator):
            if feeds.get("source") is not iterator:
                feeds.clear()  # the previous epoch's feed and its dataset go now
                # Keras passes each epoch iterator here unadvanced the first time (TFEpochIterator
                # only hands it on; _maybe_symbolic_build pulls a batch only under a tf.distribute
                # strategy and then resets the iterators), so the feed may take its dataset over
                feed = _data.BatchFeed(iterator, mesh, batch_axis, fresh=True)
                feeds.update(source=iterator, feed=feed)
            outputs = None
            for _, (data, even) in zip(range(self.steps_per_execution), feeds["feed"]):
                outputs = one_step(data, even)
            if outputs is None:
                feeds.clear()
                raise StopIteration
            feeds["feed"].place_next()  # while the step computes, before Keras waits for its logs
            return outputs

        function.one_step = one_step
        function.feeds = feeds
        return _in_model_distribution(self, function)

    def make_predict_function(self, force=False):
        if not is_distributed(self):
            return original_predict(self, force=force)
        if self.predict_function is not None and not force:
            return self.predict_function
        check_layout_map(self)
        mesh, batch_axis = mesh_of(self)
        step = _steps(self, self.predict_step, mesh, batch_axis)

        def predict_function(data):
            outputs = None
            for batch in data:
                out = step(batch)
                out = tf.nest.map_structure(_data.gather_to_numpy, out)
                outputs = out if outputs is None else tf.nest.map_structure(
                    lambda a, b: np.concatenate([a, b]), outputs, out
                )
            # Keras concatenates and converts host tensors after the loop
            return tf.nest.map_structure(tf.convert_to_tensor, outputs)

        self.predict_function = _in_model_distribution(self, predict_function)
        return self.predict_function

    original_compile = _patches.original("keras.src.trainers.trainer:Trainer.compile")

    def compile(self, *args, **kwargs):
        return _in_model_distribution(self, functools.partial(original_compile, self))(*args, **kwargs)

    _patches.install("keras.src.trainers.trainer:Trainer.compile", compile)
    _patches.install(trainer + "_make_function", _make_function)
    _patches.install(trainer + "make_predict_function", make_predict_function)
