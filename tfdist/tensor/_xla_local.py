"""Per-device programs compiled by XLA inside TF DTensor programs (the shard_map pattern).

On CPU and GPU meshes TF DTensor runs each device's share of a program as TF ops, and it
takes apart any jit-compiled function before it expands a program (docs/design.md, "XLA for
the per-device programs").  This module gets XLA in anyway, for a function of *local*
tensors:

- the function is traced once at the local shapes, lowered to StableHLO by TF itself
  (``experimental_get_compiler_ir(stage="stablehlo")``) and called through one
  ``XlaCallModule`` op.  TF registers that op on CPU and GPU devices with an XLA kernel that
  compiles on first use (``XlaCompileOnDemandOp``, ``tensorflow/compiler/jit/
  xla_ops_on_regular_devices.cc``), so each device runs the module compiled;
- TF DTensor has no expansion rule for ``XlaCallModule``; it takes the op as a replicated op
  when ``DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.XLACALLMODULE`` is set (read by that
  name in ``SPMDExpanderRegistry::GetPropagateFnForFullOpName``, ``spmd_expander.cc``), and it
  does not expand an op whose operand has a *parted* layout
  (``SkipExpansionForPartedLayout``): such an op runs on each device's local tensors as they
  are.  So sharded inputs enter the op with their layout's parted form and no data moves;
- the op's outputs carry DTensor's idea of a replicated parted tensor of the local shape.
  Each output has one leading axis of size 1 per mesh dim its value varies over; adding
  zeros laid out with those axes sharded (``k`` each) gives the same local values the
  global shape and layout they have (the add is not expanded either: its operand is parted),
  and a relayout to the plain layout ends the parted region.

Gradients: a second module computes the function's vector-Jacobian product per device
(the forward recomputed inside it, so nothing crosses between the two modules); the
gradient of an input replicated over some of the mesh dims the outputs vary over is summed
over those dims by TF DTensor (an all-reduce), as a vectorised per-device call would.

TPU meshes: TF DTensor compiles the whole program with XLA there, so callers keep their
TF-op form (``xla_platform`` returns None).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

__all__ = ["xla_platform", "PerDeviceProgram", "NotCompilable"]

_REPLICATED_DEFAULT = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.XLACALLMODULE"
# XlaCallModule's own versioning (the op's ``version`` attr): 9 is the version jax2tf writes
# today and TF 2.21's loader reads (kVersionMaximumSupported).
_CALL_MODULE_VERSION = 9


def xla_platform(device_type: str) -> str | None:
    """The ``XlaCallModule`` platform for a mesh of ``device_type``, or None where TF DTensor
    compiles the whole program with XLA itself (TPU).

    Example::

        xla_platform("GPU")   # "CUDA" ("ROCM" on a ROCm build of TF)
    """
    kind = device_type.upper()
    if kind == "CPU":
        return "CPU"
    if kind == "GPU":
        return "ROCM" if tf.test.is_built_with_rocm() else "CUDA"
    return None


class NotCompilable(ValueError):
    """The local function cannot become one XLA program: an op without an XLA kernel (TF's
    message), outputs without static shapes, or tensors captured from the enclosing program."""


@dataclass(frozen=True)
class LocalInput:
    """One argument of a per-device program: its stacked global shape, its layout, and the mesh
    dims of its leading per-device axes (size 1 on each device), in mesh order."""

    shape: tuple[int, ...]
    dtype: tf.DType
    layout: dtensor.Layout
    lead_dims: tuple[int, ...]

    @property
    def lead(self) -> int:
        return len(self.lead_dims)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (1,) * self.lead + self.shape[self.lead:]


def _stablehlo(fn: Callable, specs: Sequence[tf.TensorSpec]) -> tuple[bytes, list[tf.TensorSpec], list]:
    """``fn`` at ``specs`` as a StableHLO portable artifact, the specs of its outputs, and the
    constants it captured (eager tensors: the module takes them after its arguments)."""
    from tensorflow.compiler.mlir.stablehlo import stablehlo

    traced = tf.function(fn, jit_compile=True, autograph=False)
    concrete = traced.get_concrete_function(*specs)
    captures = list(concrete.captured_inputs)
    symbolic = [c for c in captures
                if not isinstance(c, tf.__internal__.EagerTensor) or c.dtype in (tf.resource, tf.variant)]
    if symbolic:
        raise NotCompilable(
            "jit_compile=True: the local function captures tensors or variables of the enclosing "
            f"program ({[getattr(c, 'name', c) for c in symbolic][:4]}); XLA compiles it on its own, "
            "so pass them as arguments (DTensors, with their placements) instead.")
    outs = [tf.TensorSpec(o.shape, o.dtype) for o in tf.nest.flatten(concrete.structured_outputs)]
    if any(not o.shape.is_fully_defined() for o in outs):
        raise NotCompilable(
            "jit_compile=True: the local function's outputs must have static shapes at the local "
            f"input shapes; got {[tuple(o.shape) for o in outs]}.")
    try:
        text = traced.experimental_get_compiler_ir(*specs)(stage="stablehlo")
    except ValueError as error:  # TF: "Failed getting HLO text: ... unsupported operations ..."
        raise NotCompilable(
            f"jit_compile=True: XLA cannot compile the local function: {str(error).splitlines()[0][:400]}") from None
    module = stablehlo.serialize_portable_artifact_str(text, stablehlo.get_current_version())
    return module, outs, captures


def _call_module(compiled: tuple, args: list, platform: str, mesh: dtensor.Mesh) -> list:
    """One XlaCallModule op of ``compiled`` (``_stablehlo``'s result) on ``args``, its captured
    constants passed after them, replicated."""
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    module, outs, captures = compiled
    args = list(args) + [dtensor.copy_to_mesh(c, dtensor.Layout.replicated(mesh, c.shape.rank)) for c in captures]

    os.environ.setdefault(_REPLICATED_DEFAULT, "1")  # read when DTensor first expands the op
    return gen_xla_ops.xla_call_module(
        args, version=_CALL_MODULE_VERSION, module=module, Sout=[o.shape for o in outs],
        Tout=[o.dtype for o in outs], platforms=[platform], dim_args_spec=[], function_list=[],
        has_token_input_output=False, disabled_checks=[])


def _enter_local(x: tf.Tensor, spec: LocalInput) -> tf.Tensor:
    """A stacked input as the op reads it: its parted layout where it varies by device."""
    return dtensor.relayout(x, spec.layout.to_parted()) if spec.lead else x


def _leave_local(y: tf.Tensor, layout: dtensor.Layout, shape: Sequence[int], lead: int) -> tf.Tensor:
    """A module output (the local value, ``lead`` leading axes of size 1) as the stacked global
    tensor ``shape`` laid out ``layout`` (those axes sharded): see the module docstring."""
    if not lead:
        return y
    zeros = dtensor.call_with_layout(tf.zeros, layout, list(shape), dtype=y.dtype)
    return dtensor.relayout(y + zeros, layout)


class PerDeviceProgram:
    """``fn`` (a function of local tensors) run on every device of a mesh, compiled by XLA.

    Args:
        fn: takes one local tensor per input (the leading per-device axes removed) and returns
            a tensor or a tuple/list of tensors, static shapes at the local input shapes.
        inputs: one ``LocalInput`` per argument (stacked views, see ``local_map``).
        out_layout: the layout of every stacked output's leading axes and rest, given its rank
            (a function of the rank).
        out_dims: the mesh dims of each output's leading per-device axes, in mesh order (every
            mesh dim some input varies on); ``out_sizes`` their sizes.
        platform: ``xla_platform(mesh.device_type)``.

    Calling it with the stacked input tensors returns the stacked outputs (each with
    ``out_lead`` leading axes), in ``fn``'s structure; differentiable in every floating input.

    Example (a stacked view of ``x`` over 8 devices, ``(8, 64, 256)`` sharded on its first axis)::

        program = PerDeviceProgram(lambda t: tf.nn.gelu(t @ w0), [LocalInput(...)], ...)
        y = program(x_stacked)
    """

    def __init__(self, fn: Callable, inputs: Sequence[LocalInput],
                 out_layout: Callable[[int], dtensor.Layout], out_dims: Sequence[int],
                 out_sizes: Sequence[int], platform: str) -> None:
        self._fn = fn
        self._inputs = list(inputs)
        self._out_layout = out_layout
        self._out_dims = tuple(out_dims)
        self._out_lead = len(self._out_dims)
        self._out_sizes = tuple(out_sizes)
        self._platform = platform
        specs = [tf.TensorSpec(i.local_shape, i.dtype) for i in self._inputs]
        self._specs = specs
        self._structure = None
        self._forward = _stablehlo(self._local, specs)
        self._forward_outs = self._forward[1]
        self._mesh = self._inputs[0].layout.mesh if self._inputs else None
        self._backward = None  # built when a gradient is first asked for
        self._eager = None  # the call as one traced program, for eager callers

    def _local(self, *xs: tf.Tensor):
        """``fn`` on the local tensors, each output given ``out_lead`` leading axes of size 1."""
        inner = [tf.reshape(x, i.shape[i.lead:]) for x, i in zip(xs, self._inputs)]
        result = self._fn(*inner)
        flat = tf.nest.flatten(result)
        if not flat or not all(isinstance(t, tf.Tensor) for t in flat):
            raise NotCompilable(
                "jit_compile=True: the local function must return tensors (a tensor or a tuple/list "
                f"of them); got {result!r}.")
        self._structure = result
        return [tf.reshape(t, [1] * self._out_lead + t.shape.as_list()) for t in flat]

    def _differentiable(self) -> list[int]:
        return [k for k, i in enumerate(self._inputs) if i.dtype.is_floating or i.dtype.is_complex]

    def _local_vjp(self, *xs_and_dys: tf.Tensor):
        """Per device: the gradients of the differentiable inputs, each with the outputs' leading
        axes (so the stacked gradient can be summed over the mesh dims the input does not vary on)."""
        n = len(self._inputs)
        xs, dys = list(xs_and_dys[:n]), list(xs_and_dys[n:])
        wrt = [xs[k] for k in self._differentiable()]
        with tf.GradientTape() as tape:
            tape.watch(wrt)
            ys = self._local(*xs)
        grads = tape.gradient(ys, wrt, output_gradients=dys,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.reshape(g, [1] * self._out_lead + list(self._inputs[k].shape[self._inputs[k].lead:]))
                for g, k in zip(grads, self._differentiable())]

    def _outputs(self, raw: list) -> list:
        stacked = []
        for y, spec in zip(raw, self._forward_outs):
            shape = list(self._out_sizes) + spec.shape.as_list()[self._out_lead:]
            stacked.append(_leave_local(y, self._out_layout(len(shape)), shape, self._out_lead))
        return stacked

    def prepare_gradient(self) -> None:
        """Compiles the gradient's program now (else at the first gradient), so that an op XLA
        cannot differentiate is reported (``NotCompilable``) before the forward is used."""
        if self._backward is None:
            dy_specs = [tf.TensorSpec(o.shape, o.dtype) for o in self._forward_outs]
            self._backward = _stablehlo(self._local_vjp, self._specs + dy_specs)

    def _gradients(self, xs: list, dys: list) -> list:
        self.prepare_gradient()
        entered = [_enter_local(x, i) for x, i in zip(xs, self._inputs)]
        entered_dys = []
        for dy, spec in zip(dys, self._forward_outs):
            layout = self._out_layout(spec.shape.rank)
            dy = dtensor.relayout(dy, layout)  # the stacked output's own layout
            entered_dys.append(dtensor.relayout(dy, layout.to_parted()) if self._out_lead else dy)
        raw = _call_module(self._backward, entered + entered_dys, self._platform, self._mesh)
        grads: list = [None] * len(self._inputs)
        for g, k in zip(raw, self._differentiable()):
            spec = self._inputs[k]
            rest = list(spec.shape[spec.lead:])
            shape = list(self._out_sizes) + rest
            g = _leave_local(g, self._out_layout(len(shape)), shape, self._out_lead)
            # summed over the per-device axes of the outputs that the input does not vary on
            extra = [a for a, m in enumerate(self._out_dims) if m not in spec.lead_dims]
            if extra:
                g = tf.reduce_sum(g, axis=extra)
            grads[k] = dtensor.relayout(g, spec.layout)
        return grads

    def _run(self, *xs: tf.Tensor) -> list:
        @tf.custom_gradient
        def run(*args):
            entered = [_enter_local(x, i) for x, i in zip(args, self._inputs)]
            outs = self._outputs(_call_module(self._forward, entered, self._platform, self._mesh))

            def grad(*dys):
                return self._gradients(list(args), list(dys))

            return outs, grad

        return list(run(*xs))

    def __call__(self, *xs: tf.Tensor) -> Any:
        if len(xs) != len(self._inputs):
            raise ValueError(f"expected {len(self._inputs)} inputs, got {len(xs)}")
        if tf.executing_eagerly():
            # One program: op by op, TF DTensor would lay out each op of the parted region on its
            # own, and an eager add of a parted operand is not left unexpanded as in a program.
            if self._eager is None:
                self._eager = tf.function(self._run, autograph=False)
            flat = self._eager(*xs)
        else:
            flat = self._run(*xs)
        return tf.nest.pack_sequence_as(self._structure, list(flat))
