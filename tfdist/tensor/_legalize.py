"""Layouts TF DTensor's SPMD expanders cannot expand, pinned to layouts they can.

TF DTensor lays a traced program out after tracing (layout propagation, in MLIR) and then
expands each op for its operands' and result's layouts.  Propagation merges what an op's
producers and consumers ask for; it does not ask the op's expander whether the merged layouts
are ones it can expand.  Where they are not, the expander stops the whole program: a gather
whose params and output disagree on a non-axis dim, a reduction asked for a result less
sharded than its input gives, a split along a sharded dim, a transpose that would need
communication (``LIMITS`` below, each with the TF line it answers).  Which layouts meet an op
is known only to TF's propagation, after tracing, and depends on the whole program (a layout
map entry three layers away changes it), so no list of call sites can anticipate them.

The one rule here: every op of a kind the table lists carries its graph name as an attribute
(``_legalize_op``), which TF DTensor prints with an expander's error.  When an expander refuses
an op, ``Legalizer`` reads the op, its type and the layouts TF chose from the error, pins that
op's result (and, where the table says, its operands) to layouts its expander accepts -- the
cheapest the table knows; else its operands and results replicated for that op -- and traces
the program again with those pins as ``Relayout`` ops around it.  Nothing has run when TF
DTensor refuses a program (it expands before executing), so a retry sees the same state.  A
pin applies to every op of the same type and ranks whose graph name differs only in numbers
before its last component (the same op in the next transformer layer), so a model of N layers
is legalized in as many rounds as it has kinds of refused ops, not N times that.  A program TF
expands as it is is traced and run once, as before: the pins cost only where TF refused.  Only
the table's kinds are tagged: an attribute keeps TF's common-subexpression elimination from
merging two otherwise equal ops (tagging every op cost HSDP a shared all-gather per use).

Where TF's expansion is *wrong* rather than refused there is no error to read, so such a
combination is avoided for every program traced on a mesh: an einsum contracting two or more
labels contracts one merged dim (``_merged_contraction``).

Example::

    step = Legalizer(tf.function(train_step))
    loss = step(batch)          # traced, refused ops pinned, traced again, run
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import re
import threading
import weakref
from typing import Any, Callable, Iterator, TypeVar

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.dtensor.python import api as dtensor_api
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context
from tensorflow.python.framework import op_callbacks

from tfdist import _patches, _runtime
from tfdist.tensor import _step_checks

__all__ = ["LIMITS", "Limit", "Failure", "Legalizer", "LayoutLegalizationError", "tagging", "parse_failure",
           "install"]

T = TypeVar("T")
_LOG = logging.getLogger("tfdist.legalize")
TAG = "_legalize_op"
# rounds of pinning one program may take before tfdist gives up (each round is one trace and
# one layout propagation; a round pins every op of one kind)
MAX_ROUNDS = 64


class LayoutLegalizationError(ValueError):
    """TF DTensor refused an op's layouts and pinning them did not help."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """An op TF DTensor's SPMD expansion refused, as its error describes it."""

    op_type: str  # TF's op name ("GatherV2")
    op_name: str  # the op's name in its graph (a Keras layer path)
    input_ranks: tuple[int, ...]
    output_ranks: tuple[int, ...]
    layouts: tuple[str, ...]  # every layout the message names, in order
    mesh: str  # the mesh of those layouts, as TF prints it
    reason: str  # the expander's own sentence

    def layout(self, specs: list[str]) -> str:
        return "sharding_specs:" + "".join(s + "," for s in specs) + " mesh:" + self.mesh


@dataclasses.dataclass(frozen=True)
class Pin:
    """Layouts (TF layout strings) an op's operands and results are relayouted to."""

    inputs: dict
    outputs: dict


@dataclasses.dataclass(frozen=True)
class Limit:
    """One kind of layout a TF DTensor expander refuses, and the pin that avoids it."""

    op_types: tuple[str, ...]
    message: str  # a regular expression on TF's error
    tf_source: str  # the TF line that refuses (tensorflow/dtensor/mlir/...)
    fix: Callable[[Failure, "re.Match[str]"], Pin | None]


def _specs(layout: str) -> list[str]:
    return layout.split(" mesh:")[0].removeprefix("sharding_specs:").rstrip(",").split(",")


def _replicated(failure: Failure, match: Any = None) -> Pin:
    """Every operand and result of rank >= 1 replicated: each expander handles that."""
    unsharded = dtensor.UNSHARDED
    return Pin(
        inputs={i: failure.layout([unsharded] * r) for i, r in enumerate(failure.input_ranks) if r > 0},
        outputs={j: failure.layout([unsharded] * r) for j, r in enumerate(failure.output_ranks) if r > 0},
    )


def _gather_output(failure: Failure, match: "re.Match[str]") -> Pin | None:
    """The gather's result pinned to what its operands give: its indices' dims as the output
    had them, params' other dims as params has them (a mesh dim used twice: params keep it)."""
    params, output, axis = _specs(match["params"]), _specs(match["output"]), int(match["axis"])
    n_indices = len(output) - len(params) + 1
    kept = {s for i, s in enumerate(params) if i != axis and s != dtensor.UNSHARDED}
    specs = list(params[:axis])
    specs += [s if s not in kept else dtensor.UNSHARDED for s in output[axis:axis + n_indices]]
    specs += params[axis + 1:]
    return Pin(inputs={}, outputs={0: failure.layout(specs)})


def _reduced_output(failure: Failure, match: "re.Match[str]") -> Pin:
    """The reduction's result pinned to what its input gives; the pin's relayout then gathers
    it where its consumers want it less sharded (the expander only scatters)."""
    return Pin(inputs={}, outputs={0: failure.layout(_specs(match["original"]))})


_LAYOUT = r'sharding_specs:\S*, mesh:[^\s"\]]+'

# The expanders' limits met so far, one row each.  A refused op not in the table gets its refused
# operands and results replicated (``_replicated``), so an unknown limit still compiles.
LIMITS: tuple[Limit, ...] = (
    Limit(("GatherV2", "ResourceGather"),
          rf"input and output layout do not agree on non-axis dim \d+\.\s*params: (?P<params>{_LAYOUT})"
          rf"\s*output: (?P<output>{_LAYOUT}), axis: (?P<axis>-?\d+)",
          "expansions/gather_spmd_expander.h, ExpandOpHelper: errors::InvalidArgument(\"input and output "
          "layout do not agree on non-axis dim \", i, ...) -- the result's non-axis dims must be laid out "
          "as params' are, while propagation lets consumers shard them",
          _gather_output),
    Limit(("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "L2Loss", "BiasAddGrad"),
          rf"EmitAllScatter was passed a desired_layout (?P<desired>{_LAYOUT}) which was not more sharded "
          rf"than the original_layout (?P<original>{_LAYOUT})",
          "expansions/reduce_spmd_expander.cc, ReduceSPMDExpander::ExpandOp: EmitAllScatter(builder, ..., "
          "output_layout, requested_output_layout.value(), ...) -- a reduction's result may only become "
          "more sharded than its input makes it",
          _reduced_output),
    Limit(("Squeeze", "ExpandDims", "Tile"), r"SPMD expansion resulted in op output inconsistent with the provided "
          r"layout|op requires input\.shape",
          "spmd_expander.cc, SPMDExpanderBase::ExpandOpAndSetLayout: \"SPMD expansion resulted in op output "
          "inconsistent with the provided layout\" -- the expander made the local result of another layout than "
          "propagation gave it (Squeeze of a dim-1 tensor into a sharded vector; Tile's local multiples, "
          "meta_spmd_expander.cc)", _replicated),
    Limit(("Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv2DBackpropFilter",
           "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"),
          r"channel dimension must be replicated|must be batch parallel",
          "expansions/conv_spmd_expander.cc: \"Conv input's channel dimension must be replicated.\", and for "
          "the depthwise and backprop forms \"All operands and outputs must be batch parallel.\"", _replicated),
    Limit(("Split", "SplitV"), r"Spliting over sharded dimension is not supported",
          "expansions/split_spmd_expander.cc: errors::Unimplemented(\"Spliting over sharded dimension is "
          "not supported.\")", _replicated),
    Limit(("Transpose",), r"TransposeOp SPMD needs communication is not supported yet",
          "expansions/meta_spmd_expander.cc, TransposeSPMDExpander::ExpandOp: errors::InvalidArgument("
          "\"TransposeOp SPMD needs communication is not supported yet. \\n Operand layout: \", ...)",
          _replicated),
)

# Only the table's ops carry their names: a tag is an attribute, and two ops that differ in an
# attribute are never merged by TF's common-subexpression elimination (tagging every op turned
# HSDP's shared all-gathers into one per use).
_TAGGED = frozenset(t for limit in LIMITS for t in limit.op_types)

_OP = re.compile(r'see current operation: %\S+ = "tf\.(?P<type>\w+)"\((?P<rest>.*)$', re.MULTILINE)
_NAME = re.compile(TAG + r' = "(?P<name>[^"]*)"')
_MESH = re.compile(r'sharding_specs:\S*, mesh:(?P<mesh>[^\s"\]]+)')
_TENSOR = re.compile(r"tensor<(?P<dims>[^>]*)>")


def _ranks(types: str) -> tuple[int, ...]:
    """The ranks of MLIR tensor types; 0 for an integer tensor (a shape, paddings, multiples, a
    permutation, indices: an operand TF may need as a constant to know the result's shape, so
    never pinned)."""
    ranks = []
    for m in _TENSOR.finditer(types):
        dims = m["dims"].split("x")
        rank = -1 if dims[0] == "*" else len(dims) - 1
        ranks.append(0 if rank >= 1 and re.fullmatch(r"u?i\d+", dims[-1]) else rank)
    return tuple(ranks)


def parse_failure(error: BaseException, args: Any = ()) -> Failure | None:
    """The op an expander refused, read from TF DTensor's error; None for any other error.
    ``args``: the program's arguments, whose mesh is the op's when the error prints no layout."""
    message = str(error)
    op = _OP.search(message)
    name = _NAME.search(message)
    mesh = _MESH.search(message)
    mesh = mesh["mesh"].rstrip(",") if mesh is not None else _mesh_of(args)
    if op is None or mesh is None or "spmd_expan" not in message.replace("SPMD expan", "spmd_expan"):
        return None
    signature = op["rest"].rsplit(" : ", 1)[-1]
    operands, _, results = signature.partition(" -> ")
    reason = message.split("error: ", 1)[-1].split("\n", 1)[0].strip()
    layouts = tuple(m.group(0) for m in re.finditer(_LAYOUT, message))
    # an op the expander made in the refused op's place carries no name: every op of its type
    op_name = name["name"] if name is not None else ANY_NAME
    return Failure(op["type"], op_name, _ranks(operands), _ranks(results), layouts, mesh, reason)


def _mesh_of(args: Any) -> str | None:
    """The mesh of the first eager DTensor among ``args``, else the one mesh TF DTensor knows."""
    for value in tf.nest.flatten(args, expand_composites=True):
        if isinstance(value, tf.Tensor) and not isinstance(value, tf.SparseTensor) and dtensor.is_dtensor(value):
            return dtensor.fetch_layout(value).mesh.to_string()
    device = dtensor_api._dtensor_singleton
    meshes = list(device.meshes) if device is not None else []
    return meshes[0].to_string() if len(meshes) == 1 else None


def pin_for(failure: Failure, message: str) -> Pin:
    """The table's pin for ``failure`` (its row's fix, else its operands and results replicated)."""
    for limit in LIMITS:
        if failure.op_type in limit.op_types:
            match = re.search(limit.message, message, re.DOTALL)
            if match is not None:
                pin = limit.fix(failure, match)
                if pin is not None:
                    return pin
    return _replicated(failure)


ANY_NAME = "*"  # a pin for every op of a type (TF's error named no op)


def _kind(op_type: str, name: str) -> tuple[str, str]:
    """Ops that differ only in numbers before their last name component are one kind (the same
    op of another layer, or of another trace of the same program)."""
    if name == ANY_NAME:
        return op_type, ANY_NAME
    head, _, last = name.rpartition("/")
    return op_type, re.sub(r"\d+", "#", head) + "/" + last


class Plan:
    """The pins of one program, by kind of op."""

    def __init__(self) -> None:
        self.pins: dict[tuple[str, str], tuple[Pin, tuple[int, ...], tuple[int, ...]]] = {}

    def add(self, failure: Failure, message: str) -> bool:
        """Pins ``failure``'s kind of op; False if it was pinned already (pinning did not help)."""
        kind = _kind(failure.op_type, failure.op_name)
        pin = pin_for(failure, message)
        previous = self.pins.get(kind)
        if previous is not None:
            if previous[0] == pin or previous[0] == _replicated(failure):
                return False
            pin = _replicated(failure)  # the cheap pin was not enough here: replicate
        self.pins[kind] = (pin, failure.input_ranks, failure.output_ranks)
        return True

    def pin_of(self, op_type: str, name: str, inputs: Any, outputs: Any) -> Pin | None:
        entry = self.pins.get(_kind(op_type, name)) or self.pins.get((op_type, ANY_NAME))
        if entry is None:
            return None
        pin, _, output_ranks = entry
        if tuple(t.shape.rank for t in outputs[:len(output_ranks)]) != output_ranks:
            return None
        return pin


_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("tfdist_legalize_plan", default=None)


def _relayout(tensor: tf.Tensor, layout: str) -> tf.Tensor:
    return dtensor.relayout(tensor, dtensor.Layout.from_string(layout))


def _tag(op: Any, name: str) -> None:
    op._set_attr(TAG, attr_value_pb2.AttrValue(s=name.encode()))


def _merged_contraction(op: Any, inputs: Any) -> tf.Tensor | None:
    """An einsum contracting two or more labels, as one contracting the product of their dims.

    TF DTensor's einsum expander computes a product wrongly, with no error, when one mesh dim
    shards a different contracting label in each operand (``x`` ``(batch, -, -, model)`` and
    ``w`` ``(model, -, -)`` in ``abcd,cde->abe``: keras-hub Llama's attention output with its
    value kernel's head dim and its output kernel's heads over ``model``; off by 65 in
    docs/tf_dtensor_repros/einsum_two_contracting_dims.py).  With the contracting labels merged
    into one dim there is one label a mesh dim can shard: the reshape gathers an operand whose
    sharding is on an inner merged dim, and a sharding of the outer one (the Megatron layouts)
    stays local.  Only labels contiguous and in the same order in both operands, with static
    sizes, are merged (the einsums Keras' EinsumDense and keras-hub's attention write)."""
    equation = op.get_attr("equation").decode()
    if "." in equation or len(inputs) != 2:
        return None
    lhs, _, out = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    a, b = terms
    contracted = [c for c in a if c in b and c not in out]
    if len(contracted) < 2 or len(set(a)) != len(a) or len(set(b)) != len(b):
        return None
    run = "".join(c for c in a if c in contracted)
    if run not in a or run not in b:  # not contiguous, or another order in b
        return None
    x, y = inputs
    if not x.shape.is_fully_defined() or not y.shape.is_fully_defined():
        return None
    free = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in equation)

    def merged(t: tf.Tensor, term: str) -> tf.Tensor:
        start = term.index(run)
        dims = t.shape.as_list()
        return tf.reshape(t, dims[:start] + [-1] + dims[start + len(run):])

    return tf.einsum(f"{a.replace(run, free)},{b.replace(run, free)}->{out}", merged(x, a), merged(y, b))


def _on_op(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    """Graph ops only: tag the op with its name; rewrite an expansion TF computes wrongly;
    apply the active plan's pin."""
    if graph is None or op_name is None:
        return None
    op = outputs[0].op if outputs else graph.get_operation_by_name(op_name)
    _note_empty(outputs)
    if op_type in _TAGGED:
        _tag(op, op_name)
    if op_type in _GATHERS and _step_checks.active():
        _check_gather(op, op_name)

    replaced = _merged_contraction(op, inputs) if op_type == "Einsum" and _on_a_mesh() else None
    if replaced is not None:
        op, outputs = replaced.op, [replaced]
    plan = _PLAN.get()
    pin = plan.pin_of(op_type, op_name, inputs, outputs) if plan is not None else None
    if pin is None:
        return outputs if replaced is not None else None
    for i, layout in pin.inputs.items():
        # a rewritten op's operands are not the ones the pin names
        if replaced is None and i < len(op.inputs) and op.inputs[i].shape.rank == len(_specs(layout)):
            op._update_input(i, _relayout(op.inputs[i], layout))
    return [_relayout(t, pin.outputs[j]) if j in pin.outputs else t for j, t in enumerate(outputs)]


_GATHERS = ("GatherV2", "ResourceGather")


def _check_gather(op: Any, op_name: str) -> None:
    """The gather's indices checked in the step and clipped into range (``_step_checks``): an id
    outside the table raises on the host after the step, as TF's kernel raises on one device."""
    size = _step_checks.gather_size(op)
    indices = op.inputs[1]
    if size is None or indices.op.type == "Const":
        return
    message = f"indices = {{value}} is not in [0, {size}) ({op.type} '{op_name}', checked on the mesh by tfdist)"
    checked = _step_checks.checked_indices(indices, size, message)
    if checked is not indices:
        op._update_input(1, checked)


def _on_a_mesh() -> bool:
    """A DTensor device exists in this process (before one does, nothing runs on a mesh)."""
    return dtensor_api._dtensor_singleton is not None


@contextlib.contextmanager
def tagging(plan: Plan | None = None) -> Iterator[None]:
    """Ops traced in this thread inside the block carry their names (and ``plan``'s pins)."""
    token = _PLAN.set(plan if plan is not None else _PLAN.get())
    # TF keeps a thread's callbacks as a set: the outermost block adds and removes it
    outermost = _on_op not in context.context().op_callbacks
    if outermost:
        op_callbacks.add_op_callback(_on_op)
    try:
        yield
    finally:
        if outermost:
            op_callbacks.remove_op_callback(_on_op)
            restore = getattr(_EMPTY, "restore", None)
            if restore is not None:
                _EMPTY.restore = None
                restore()
        _PLAN.reset(token)


_EMPTY = threading.local()  # .restore: undoes the gather lowering switch for empty tensors


def _note_empty(outputs: Any) -> None:
    """A traced value with no elements: the program is expanded with TF's all-reduce gather
    lowering (``_runtime.all_reduce_gather_lowering``: CollectiveGatherV2 of an empty tensor
    kills the process)."""
    if getattr(_EMPTY, "restore", None) is not None:
        return
    # values of rank >= 2, not constants: an empty vector is a shape (of a scalar), kept on the host
    if any(t.shape.rank is not None and t.shape.rank >= 2 and t.shape.is_fully_defined()
           and t.shape.num_elements() == 0 and t.op.type != "Const" for t in outputs):
        _EMPTY.restore = _runtime.all_reduce_gather_lowering()


def gather_lowering_failed(error: BaseException) -> bool:
    """TF DTensor's CollectiveGatherV2 lowering failed to compile a gather over two mesh dims at
    once that an expander emitted (docs/tf_dtensor_repros/all_gather_two_mesh_dims.py):
    ``collective_lowering.cc``: "'tf.Reshape' op requires 'output' number of elements to match"."""
    message = str(error)
    return (_runtime.gather_lowering_is_collective() and "collective_lowering.cc" in message
            and "number of elements to match" in message)


@contextlib.contextmanager
def _all_reduce_gathers() -> Iterator[None]:
    restore = _runtime.all_reduce_gather_lowering()
    try:
        yield
    finally:
        restore()


def _explain(failure: Failure, pinned: bool) -> LayoutLegalizationError:
    specs = dict.fromkeys("(" + ", ".join(_specs(layout)) + ")" for layout in failure.layouts)
    layouts = "; ".join(specs) or "(none printed)"
    tried = " tfdist pinned this op's layouts and TF DTensor still refused it." if pinned else ""
    return LayoutLegalizationError(
        f"TF DTensor cannot lay out {failure.op_type} '{failure.op_name}' (the layer or variable is the "
        f"path in that name): {failure.reason} Layouts: {layouts}.{tried} Change the layout map entry of "
        f"the weights this op reads, or replicate them.")


class Legalizer:
    """A ``tf.function`` traced with tags; retraced with pins while TF DTensor refuses an op.

    ``run(attempt)`` calls ``attempt(function)`` (trace and first call); ``__call__`` calls the
    current function.  After a refusal the function is a fresh clone (TF caches its traces)."""

    def __init__(self, function: Any) -> None:
        self.function = function
        self.plan = Plan()
        self.gathers_by_all_reduce = False  # expanded with TF's all-reduce gather lowering

    def lower_gathers_by_all_reduce(self) -> None:
        """From now on the program is expanded with TF's all-reduce lowering of all-gathers."""
        _LOG.info("TF DTensor's CollectiveGatherV2 lowering failed on a gather over two mesh dims; expanding "
                  "the program again with its all-reduce lowering")
        self.gathers_by_all_reduce = True
        self.function = self.function._clone(None)

    def run(self, attempt: Callable[[Any], T], failure: tuple[Failure, str] | None = None, args: Any = ()) -> T:
        rounds = 0
        while True:
            if failure is not None:
                found, message = failure
                if rounds >= MAX_ROUNDS or not self.plan.add(found, message):
                    raise _explain(found, pinned=True)
                _LOG.info("TF DTensor refused %s '%s' (%s); pinned %s and tracing again",
                          found.op_type, found.op_name, found.reason, self.plan.pins[_kind(found.op_type, found.op_name)][0])
                self.function = self.function._clone(None)
                rounds += 1
            lowering = _all_reduce_gathers() if self.gathers_by_all_reduce else contextlib.nullcontext()
            with tagging(self.plan), lowering:
                try:
                    return attempt(self.function)
                except tf.errors.OpError as error:
                    found = parse_failure(error, args)
                    if found is None:
                        if self.gathers_by_all_reduce or not gather_lowering_failed(error):
                            raise
                        self.lower_gathers_by_all_reduce()
                        failure = None  # the pins so far stand; nothing new to pin
                        continue
                    failure = (found, str(error))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(lambda function: _call_unpatched(function, *args, **kwargs), args=(args, kwargs))


_LEGALIZED: "weakref.WeakKeyDictionary[Any, Legalizer]" = weakref.WeakKeyDictionary()
_ORIGINAL_CALL: list = []


def _call_unpatched(function: Any, *args: Any, **kwargs: Any) -> Any:
    return _ORIGINAL_CALL[0](function, *args, **kwargs) if _ORIGINAL_CALL else function(*args, **kwargs)


def legalizing_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.function``'s ``__call__`` traced with tags; a refused program legalized and, from
    then on, called through its ``Legalizer`` (``tfdist._patches``: ``Function.__call__``)."""
    _ORIGINAL_CALL[:] = [original]

    def __call__(self, *args, **kwargs):
        legalizer = _LEGALIZED.get(self)
        if legalizer is not None:
            return legalizer(*args, **kwargs)
        with tagging():
            try:
                return original(self, *args, **kwargs)
            except tf.errors.OpError as error:
                found = parse_failure(error, (args, kwargs))
                if found is None and not gather_lowering_failed(error):
                    raise
                failure = (found, str(error)) if found is not None else None
        legalizer = _LEGALIZED[self] = Legalizer(self)
        if failure is None:
            legalizer.lower_gathers_by_all_reduce()
        return legalizer.run(lambda function: original(function, *args, **kwargs), failure, (args, kwargs))

    return __call__


_FUNCTION_CALL = "tensorflow.python.eager.polymorphic_function.polymorphic_function:Function.__call__"


def install() -> None:
    """Every ``tf.function`` call legalizes a program TF DTensor refuses (a row of the patch table)."""
    if _patches.installed(_FUNCTION_CALL):
        return
    _patches.install(_FUNCTION_CALL, legalizing_call(_patches.original(_FUNCTION_CALL)))
