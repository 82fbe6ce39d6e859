"""Every change tfdist makes to Keras or TensorFlow internals, in one table.

Keras 3 leaves its TensorFlow ``distribution_lib`` empty and its TF variables,
optimizer and trainer know nothing of DTensor; tfdist fills and adjusts them.
Each such change is a row of :data:`PATCHES`: what is changed, why, the
version it was written against, and the parameters the original must have.
Nothing is patched except through :func:`install` (process-wide, at
``import tfdist.keras``) or :func:`scoped` (only inside a ``with`` block and
only for the thread that entered it).

Before anything is patched, :func:`check_versions` refuses a Keras or
TensorFlow minor version that tfdist was not tested with (set
``TFDIST_ALLOW_UNTESTED_VERSIONS=1`` to try anyway), and :func:`verify`
fails loudly if an internal was renamed or its signature changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import threading
from typing import Any, Callable, Iterator

__all__ = ["Patch", "PATCHES", "TESTED", "check_versions", "verify", "install", "scoped", "original"]

# package -> the minor versions tfdist's patches were written and tested against
TESTED = {"keras": ("3.15",), "tensorflow": ("2.21",)}

_ABSENT = "absent"  # Keras' TF backend lacks the function; Keras' neutral code calls it


@dataclasses.dataclass(frozen=True)
class Patch:
    """One changed attribute of a third-party module or class.

    ``params`` are the parameter names the original must have (``"absent"``:
    the attribute must not exist before tfdist adds it).  An ``owner`` that is
    a dict (a registry) has ``attribute`` as its key.  ``scope`` is
    ``"process"`` (installed at import) or ``"with"`` (inside a context
    manager only, per thread).
    """

    module: str
    owner: str | None
    attribute: str
    params: tuple[str, ...] | str
    scope: str
    why: str
    since: str = "keras 3.15, tensorflow 2.21"

    @property
    def name(self) -> str:
        owner = f"{self.owner}." if self.owner else ""
        return f"{self.module}:{owner}{self.attribute}"


_DL = "keras.src.backend.tensorflow.distribution_lib"
_CORE = "keras.src.backend.tensorflow.core"
_OPT = "keras.src.backend.tensorflow.optimizer"
_FILL = "fills Keras' empty TF distribution_lib, which keras.distribution calls"
_NOISE = "the noise layers draw a hash of (seed, global index): the same noise on every mesh"
_SET = ("refuses a value that is not a keras.distribution.Distribution or None, naming it (bound in three "
        "modules; Keras would store it and fail later inside a layer)")
_READ = "reads after writes in one traced step see the written value (TF DTensor stale read on 2-D meshes)"

PATCHES: tuple[Patch, ...] = (
    Patch(_DL, None, "_to_backend_mesh", ("device_mesh",), "process", "Keras DeviceMesh -> dtensor.Mesh"),
    Patch(_DL, None, "_to_backend_layout", ("tensor_layout",), "process", "Keras TensorLayout -> dtensor.Layout"),
    Patch(_DL, None, "distribute_value", ("value", "tensor_layout"), "process", "lays a value out with DTensor"),
    Patch(_DL, None, "distribute_tensor", _ABSENT, "process", _FILL),
    Patch(_DL, None, "distribute_variable", _ABSENT, "process", _FILL),
    Patch(_DL, None, "num_processes", _ABSENT, "process", _FILL),
    Patch(_DL, None, "process_id", _ABSENT, "process", _FILL),
    Patch(_DL, None, "get_device_count", _ABSENT, "process", _FILL),
    Patch(_DL, None, "list_devices", ("device_type",), "process",
          "every client's devices numbered globally (TF's logical devices repeat local numbers per client)"),
    Patch(_DL, None, "initialize", _ABSENT, "process",
          "keras.distribution.initialize on TF: joins tfdist's multi-client runtime"),
    *(Patch(module, None, "set_distribution", ("value",), "process", _SET)
      for module in ("keras.src.distribution.distribution_lib", "keras.src.distribution", "keras.distribution")),
    Patch(_CORE, "Variable", "_initialize", ("self", "value"), "process",
          "a variable with a layout is created as a dtensor.DVariable"),
    Patch(_CORE, "Variable", "_direct_assign", ("self", "value"), "process", _READ),
    Patch(_CORE, "Variable", "value", ("self",), "process",
          _READ + "; inside an FSDP layer's call, a parameter reads as its all-gathered value"),
    Patch(_CORE, "Variable", "handle", ("self",), "process", "the DVariable's handle"),
    Patch(_CORE, "Variable", "numpy", ("self",), "process", "gathers a sharded variable to one array"),
    Patch("keras.src.backend.tensorflow.math", None, "top_k", ("x", "k", "sorted"), "process",
          "under a keras distribution, top_k's gradient is a one-hot product: TF DTensor expands TopKV2's "
          "ScatterNd gradient with global indices on a local shard (tfdist/keras/_expandable_ops.py)"),
    Patch("keras.src.backend.tensorflow.nn", None, "one_hot", ("x", "num_classes", "axis", "dtype", "sparse"),
          "process", "under a keras distribution, one_hot is ids == range(n): TF DTensor's OneHot expansion keeps "
          "the global type when its class dim is sharded (tfdist/keras/_expandable_ops.py)"),
    Patch("keras.src.backend.tensorflow.numpy", None, "stack", ("x", "axis"), "process",
          "under a keras distribution, in a traced program, stack is a concat of expanded tensors: TF DTensor's "
          "Unpack expansion (stack's gradient) ignores a layout change of other dims "
          "(tfdist/keras/_expandable_ops.py)"),
    Patch(_CORE, None, "slice_update", ("inputs", "start_indices", "updates"), "process",
          "under a keras distribution, in a traced program, slice_update is a gather and a select: TF DTensor "
          "cannot lay out XlaDynamicUpdateSlice (tfdist/keras/_expandable_ops.py)"),
    Patch("keras.src.backend", None, "convert_to_numpy", ("x",), "process",
          "keras.ops.convert_to_numpy of a sharded DTensor (a model's eager output) gathers it to one array, "
          "as on JAX; TF refuses to copy a sharded DTensor to the host"),
    Patch(_CORE, "Variable", "__array__", ("self", "dtype"), "process", "gathers a sharded variable to one array"),
    Patch("keras.src.saving.saving_lib", None, "_get_unique_name", ("name", "used_names"), "process",
          "a module whose class tfdist swapped (FSDPDense, ...) is filed in a weights file under its own "
          "class's name, so a model without tfdist loads the file"),
    Patch("keras.src.layers.layer", "Layer", "add_weight",
          ("self", "args", "shape", "initializer", "dtype", "trainable", "autocast", "regularizer",
           "constraint", "aggregation", "overwrite_with_gradient", "name"), "process",
          "lets variable creation see its layer, so a style's layout reaches weights created later"),
    Patch(_OPT, "TFOptimizer", "assign", ("self", "variable", "value"), "process", _READ),
    Patch(_OPT, "TFOptimizer", "assign_add", ("self", "variable", "value"), "process", _READ),
    Patch(_OPT, "TFOptimizer", "assign_sub", ("self", "variable", "value"), "process", _READ),
    Patch(_OPT, "TFOptimizer", "add_variable_from_reference", ("self", "reference_variable", "name", "initializer"),
          "process", "optimizer slots take their parameter's layout"),
    Patch(_OPT, "TFOptimizer", "_backend_update_step", ("self", "grads", "trainable_variables", "learning_rate"),
          "process", "IndexedSlices gradients made dense (DTensor cannot lay out ResourceScatterAdd); a variable "
          "stored padded takes Keras' backend-neutral update loop, at its Keras shape"),
    Patch(_OPT, "TFOptimizer", "_apply_weight_decay", ("self", "variables"), "process",
          "a variable stored padded decays through Keras' backend-neutral code, at its Keras shape"),
    Patch(_OPT, "TFOptimizer", "_var_key", ("self", "variable"), "process",
          "a Keras variable on a DVariable is keyed by the DVariable, also where its value is a read"),
    Patch("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply", ("self", "grads", "trainable_variables"),
          "process", "the gradient of a variable stored padded is cut to the variable's Keras shape"),
    Patch("keras.src.optimizers.base_optimizer", "BaseOptimizer", "build", ("self", "variables"), "process",
          "the optimizer's own variables (iterations, learning rate) join the mesh of the variables it trains"),
    Patch("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer", "_make_function", ("self", "step_function"),
          "process", "batches fed as DTensors from an eager iterator (TF DTensor cannot lay out IteratorGetNext)"),
    Patch("keras.src.trainers.trainer", "Trainer", "compile",
          ("self", "optimizer", "loss", "loss_weights", "metrics", "weighted_metrics", "run_eagerly",
           "steps_per_execution", "jit_compile", "auto_scale_loss"), "process",
          "a model built inside a distribution's scope and compiled outside it makes its optimizer and "
          "metrics under that distribution, as Keras does inside the scope"),
    Patch("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer", "make_predict_function", ("self", "force"),
          "process", "predict batches fed as DTensors, outputs gathered"),
    Patch("keras.src.callbacks.callback_list", "CallbackList", "__init__",
          ("self", "callbacks", "add_history", "add_progbar", "model", "params"), "process",
          "for a model on a mesh, batch-end callbacks run after the next step is dispatched, where "
          "Keras' own rule would run them asynchronously on a thread-safe backend"),
    Patch("tensorflow.python.eager.polymorphic_function.concrete_function", "ConcreteFunction", "_call_flat",
          ("self", "tensor_inputs", "captured_inputs"), "process",
          "plain eager tensors passed to a tf.function on DTensors are replicated onto their mesh "
          "(torch's Replicate annotation; TF DTensor refuses them)", "tensorflow 2.21"),
    Patch("tensorflow.python.eager.polymorphic_function.polymorphic_function", "Function", "__call__",
          ("self", "args", "kwds"), "process",
          "a program TF DTensor's SPMD expansion refuses is traced again with the refused ops' layouts pinned "
          "to ones their expanders accept (tfdist/tensor/_legalize.py); other programs run as traced",
          "tensorflow 2.21"),
    Patch("tensorflow.python.eager.backprop", "GradientTape", "gradient",
          ("self", "target", "sources", "output_gradients", "unconnected_gradients"), "process",
          "an eager tape seeds a DTensor target's gradient with a DTensor (TF's host seed fails in eager DTensor)",
          "tensorflow 2.21"),
    Patch("keras.src.backend.tensorflow.random", None, "dropout", ("inputs", "rate", "noise_shape", "seed"),
          "process", "dropout masks are a hash of (seed, global index): the same on every mesh"),
    Patch("keras.src.layers.regularization.gaussian_noise", "GaussianNoise", "call", ("self", "inputs", "training"),
          "process", _NOISE),
    Patch("keras.src.layers.regularization.gaussian_dropout", "GaussianDropout", "call",
          ("self", "inputs", "training"), "process", _NOISE),
    Patch("keras.src.layers.regularization.alpha_dropout", "AlphaDropout", "call", ("self", "inputs", "training"),
          "process", _NOISE),
    Patch("keras.src.backend.tensorflow.random", None, "normal", ("shape", "mean", "stddev", "dtype", "seed"),
          "with", _NOISE),
    Patch("keras.src.backend.tensorflow.random", None, "uniform", ("shape", "minval", "maxval", "dtype", "seed"),
          "with", _NOISE),
    Patch("keras.src.layers.layer", "Layer", "__call__", ("self", "args", "kwargs"), "process",
          "plain eager inputs of a layer on a mesh are replicated onto it (torch's Replicate annotation; "
          "eager DTensor refuses host tensors), and the eager call of a built layer on a mesh runs traced, "
          "so tensors its code makes (masks, ranges) are constants TF DTensor replicates; while tfdist traces "
          "a step of a jit_compile=True data-parallel model, the model's own call runs as one XLA program per "
          "device (tfdist/keras/_compiled_forward.py)"),
    Patch("keras.src.losses.loss", "Loss", "__call__", ("self", "y_true", "y_pred", "sample_weight"), "process",
          "eager labels/sample weights beside DTensor predictions go onto their mesh (torch's Replicate annotation)"),
    Patch("keras.src.losses.loss", None, "reduce_values", ("values", "sample_weight", "reduction"), "with",
          "inside traced distributed steps a mean loss is one tf.reduce_mean (a Mean all-reduce), so TF DTensor's "
          "combiner does not put the loss scalar ahead of the gradients and misalign their slices"),
    Patch("keras.src.backend.tensorflow.nn", None, "sparse_categorical_crossentropy",
          ("target", "output", "from_logits", "axis"), "with",
          "loss_parallel: cross-entropy on class-sharded logits without a gather"),
    Patch("tensorflow.nn", None, "sparse_softmax_cross_entropy_with_logits", ("labels", "logits", "name"), "with",
          "loss_parallel: cross-entropy on class-sharded logits without a gather"),
    Patch("tensorflow.python.ops.parallel_for.pfor", "_pfor_converter_registry", "Relayout", _ABSENT, "with",
          "HSDP: TF's vectoriser has no converter for DTensor's Relayout; while a replica group's program is "
          "vectorised, a stacked relayout keeps its leading axis on the replicate mesh dim "
          "(tfdist/fsdp/_replica_groups.py)", "tensorflow 2.21"),
    *(Patch("tensorflow.python.ops.parallel_for.pfor", "_pfor_converter_registry", op, ("pfor_input",), "with",
            "HSDP: a vectorised softmax of rank > 5 (an attention's scores with a group axis) is computed from "
            "exp and sums: TF's oneDNN softmax kernel takes at most 5 dims (tfdist/fsdp/_replica_groups.py)",
            "tensorflow 2.21") for op in ("Softmax", "LogSoftmax")),
    Patch("keras.src.layers.attention.multi_head_attention", "MultiHeadAttention", "_compute_attention",
          ("self", "query", "key", "value", "attention_mask", "training", "return_attention_scores",
           "use_causal_mask"), "with", "context_parallel: queries sequence-sharded, keys/values gathered"),
)

_BY_NAME = {p.name: p for p in PATCHES}
_MISSING = object()
_ORIGINALS: dict[str, Any] = {}
_lock = threading.Lock()


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check_versions() -> None:
    """Raises ImportError on a Keras/TensorFlow minor version tfdist was not tested with."""
    if os.environ.get("TFDIST_ALLOW_UNTESTED_VERSIONS") == "1":
        return
    for package, tested in TESTED.items():
        version = importlib.import_module(package).__version__
        if _minor(version) not in tested:
            raise ImportError(
                f"tfdist.keras changes {package} internals written against {package} "
                f"{', '.join(tested)}; {package} {version} is installed. Install a tested "
                f"version (pip install -e . pins them), or set TFDIST_ALLOW_UNTESTED_VERSIONS=1 "
                "to try anyway (tfdist._patches.verify() then lists what no longer fits)."
            )


def _holder(patch: Patch) -> Any:
    obj = importlib.import_module(patch.module)
    return getattr(obj, patch.owner) if patch.owner else obj


def _params(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, property):
        value = value.fget
    try:
        return tuple(inspect.signature(value).parameters)
    except (TypeError, ValueError):
        return None


def _current(patch: Patch) -> Any:
    holder = _holder(patch)
    if isinstance(holder, dict):
        return holder.get(patch.attribute, _MISSING)
    if patch.owner:
        return inspect.getattr_static(holder, patch.attribute, _MISSING)
    return getattr(holder, patch.attribute, _MISSING)


def _put(patch: Patch, value: Any) -> None:
    holder = _holder(patch)
    if not isinstance(holder, dict):
        setattr(holder, patch.attribute, value)
    elif value is _MISSING:
        holder.pop(patch.attribute, None)
    else:
        holder[patch.attribute] = value


def original(name: str) -> Any:
    """The attribute as it was before tfdist changed it (a sentinel if it did not exist)."""
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    return _current(_BY_NAME[name])


def verify(patch: Patch) -> str | None:
    """What no longer fits in this Keras/TF for ``patch``, or None."""
    try:
        value = _ORIGINALS[patch.name] if patch.name in _ORIGINALS else _current(patch)
    except (ImportError, AttributeError) as e:
        return f"{patch.name}: the owner is gone ({e})"
    if patch.params == _ABSENT:
        return None if value is _MISSING else f"{patch.name}: now exists in Keras; tfdist would replace it"
    if value is _MISSING:
        return f"{patch.name}: no longer exists"
    params = _params(value)
    if params != patch.params:
        return f"{patch.name}: parameters are {params}, tfdist expects {patch.params}"
    return None


def _checked(name: str) -> Patch:
    patch = _BY_NAME.get(name)
    if patch is None:
        raise KeyError(f"{name!r} is not in tfdist._patches.PATCHES; add a row before patching it")
    problem = verify(patch)
    if problem is not None:
        raise ImportError(
            f"tfdist cannot adapt this Keras/TensorFlow: {problem}. Install a tested version "
            f"({TESTED})."
        )
    return patch


def installed(name: str) -> bool:
    """tfdist has replaced this process-wide attribute (an install function runs once)."""
    return name in _ORIGINALS


def install(name: str, replacement: Any) -> Any:
    """Replaces a process-wide attribute listed in PATCHES; returns the original."""
    patch = _checked(name)
    if patch.scope != "process":
        raise ValueError(f"{name} is a with-block patch; use scoped()")
    with _lock:
        if name not in _ORIGINALS:
            _ORIGINALS[name] = _current(patch)
        _put(patch, replacement)
    value = _ORIGINALS[name]
    return None if value is _MISSING else value


class _Scoped:
    """A with-block patch: installed while any thread is inside, active only for those threads."""

    def __init__(self, patch: Patch) -> None:
        self.patch = patch
        self.users = 0
        self.local = threading.local()
        self.original: Any = None

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        stack = getattr(self.local, "stack", None)
        if stack:
            return stack[-1](self.original, *args, **kwargs)
        if self.original is _MISSING:  # added by tfdist, and this thread is outside the block
            raise NotImplementedError(f"{self.patch.name} exists only inside tfdist's with-block")
        return self.original(*args, **kwargs)


_SCOPED: dict[str, _Scoped] = {}


@contextlib.contextmanager
def scoped(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Within the block, this thread's calls go to ``replacement(original, *args, **kwargs)``.

    The attribute is swapped for a dispatcher while at least one thread is
    inside such a block and restored when the last one leaves; other threads
    meanwhile get the original behaviour.
    """
    patch = _checked(name)
    if patch.scope != "with":
        raise ValueError(f"{name} is a process-wide patch; use install()")
    with _lock:
        state = _SCOPED.get(name)
        if state is None:
            state = _SCOPED[name] = _Scoped(patch)
        if state.users == 0:
            state.original = _current(patch)
            dispatch = state.dispatch
            if patch.owner:  # a method: keep ``self`` by installing a plain function
                def dispatch(*args, _state=state, **kwargs):
                    return _state.dispatch(*args, **kwargs)
            _put(patch, dispatch)
        state.users += 1
    stack = getattr(state.local, "stack", None)
    if stack is None:
        stack = state.local.stack = []
    stack.append(replacement)
    try:
        yield
    finally:
        stack.pop()
        with _lock:
            state.users -= 1
            if state.users == 0:
                _put(patch, state.original)
