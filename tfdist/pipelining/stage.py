"""PipelineStage: one piece of a model on its own device or sub-mesh (torch.distributed.pipelining.stage).

Each stage runs compiled TensorFlow programs on its devices.  A microbatch's
forward runs as one compiled program under an eager ``GradientTape``: calling a
``tf.function`` under a tape makes TensorFlow run the forward half of the
forward/backward pair it builds for the function's gradient, which also
returns the activations the backward needs, and the tape keeps them.  The
stage's backward is then ``tape.gradient``: one compiled backward program fed
with those activations, as torch's autograd is fed with its saved tensors.
So a stage holds each microbatch's activations between its forward and its
backward, and computes one forward and one backward per microbatch.

With ``activation_checkpoint=True`` (``torch.utils.checkpoint`` per stage) a
stage keeps only each microbatch's *input* and its backward programs run the
forward again under a tape: less memory held, a forward more of compute.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._cross_mesh import replicated_on

__all__ = ["PipelineStage", "PipeliningShapeError", "build_stage"]


# One rank thread at a time runs eager DTensor ops outside the compiled programs (moving a tensor
# onto a stage, adding gradients); the programs themselves still run concurrently. TF DTensor's
# eager op holds its device-wide mutex while it resolves a small input's value on the host
# (DTensorDevice::Execute -> ExtractSmallTensorValue -> ParallelDevice::AsyncWait, which waits for
# every pending node), and concurrent eager ops from other ranks' threads then stalled a step for
# good (stages on sub-meshes of different sizes: up to 3 runs in 3 stalled within 50 steps;
# docs/design.md, "Pipelining").
_EAGER_LOCK = threading.Lock()


class PipeliningShapeError(RuntimeError):
    """A stage produced (or received) a tensor whose shape or dtype is not the one expected."""


def _spec(t: Any) -> tuple[tuple[int | None, ...], str]:
    return tuple(t.shape.as_list() if isinstance(t.shape, tf.TensorShape) else t.shape), tf.as_dtype(t.dtype).name


def _full_name(device: str) -> str:
    """``"CPU:1"`` as this client's full device name (``/job:worker/replica:0/task:1/device:CPU:1``), so
    that the devices of stages on different clients never look alike."""
    spec = tf.DeviceSpec.from_string(device)
    for logical in tf.config.list_logical_devices(spec.device_type) if spec.device_type else []:
        found = tf.DeviceSpec.from_string(logical.name)
        if found.device_index == spec.device_index and (spec.task is None or spec.task == found.task):
            return logical.name
    return spec.to_string()


def _device_names(device: Any) -> tuple[str, ...]:
    if isinstance(device, DeviceMesh):
        return tuple(sorted(device.to_tf().local_devices()))
    return (_full_name(device),)


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: ``submodule`` run on ``device``.

    Args:
        submodule: the Keras layer or model of this stage (its input is the
            previous stage's output).
        stage_index, num_stages: this stage's place in the pipeline.
        device: a device name (``"CPU:3"``, ``"GPU:1"``) or a ``DeviceMesh``
            (a sub-mesh, on which the submodule may be tensor parallel or FSDP).
        input_args, output_args: example tensors (or ``tf.TensorSpec`` s) of
            one microbatch's input and output; given, every microbatch is
            checked against them (``PipeliningShapeError``), else the first
            microbatch's shapes are recorded and later ones checked.
        group: accepted for torch compatibility (one process holds all the
            stages of a pipeline rank; see the schedules).
        activation_checkpoint: keep only each microbatch's input between its
            forward and backward and recompute the forward in the backward
            (what ``torch.utils.checkpoint`` around the stage's module does):
            less memory, a third more compute. By default (``False``) the
            stage keeps the forward's activations and does not recompute.

    After a schedule's ``step``, ``grads`` holds the gradients of
    ``submodule.trainable_variables`` (summed over microbatches, divided by
    their number when the schedule's ``scale_grads``), ``zero_grads()`` clears them.

    Example::

        stage = PipelineStage(blocks[0], 0, 4, device="CPU:0")
        stage = PipelineStage(blocks[1], 1, 4, device="CPU:1", activation_checkpoint=True)

    Zero-bubble schedules split a backward into its input part (``I``) and
    its weight part (``W``). Without recomputation, TensorFlow's backward
    program for a compiled call computes the gradients of all the call's
    inputs at once (asking for the input gradients alone costs the same), so
    the ``I`` action computes both and the ``W`` action adds the weight
    gradients it kept; with ``activation_checkpoint=True`` they are two
    programs, each recomputing the forward.
    """

    def __init__(self, submodule: Any, stage_index: int, num_stages: int, device: Any,
                 input_args: Any = None, output_args: Any = None, group: Any = None,
                 dw_builder: Callable | None = None, *, activation_checkpoint: bool = False) -> None:
        if not isinstance(activation_checkpoint, bool):
            raise TypeError("activation_checkpoint must be a bool. Received: "
                            f"activation_checkpoint={activation_checkpoint!r}")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be a positive int. Received: num_stages={num_stages!r}")
        if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}). Received: stage_index={stage_index!r}")
        if not callable(submodule):
            raise TypeError(f"submodule must be a Keras layer or model. Received: {type(submodule).__name__}")
        if not isinstance(device, (str, DeviceMesh)):
            raise TypeError(f"device must be a device name or a DeviceMesh. Received: device={device!r}")
        if isinstance(device, DeviceMesh) and device.is_remote():
            raise ValueError(
                f"device: this client owns none of stage {stage_index}'s sub-mesh {device.mesh.tolist()}; build "
                "a stage on the clients whose devices its sub-mesh holds (each of them builds it)."
            )
        self.submod = submodule
        self.stage_index, self.num_stages = stage_index, num_stages
        self.device = device
        self.devices = _device_names(device)  # full names of this client's devices of the stage
        self.device_key = ",".join(self.devices)
        self.group = group
        self.activation_checkpoint = activation_checkpoint
        self.record_for_backward = True  # False while a schedule runs eval(): nothing is kept for a backward
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._expected_in = self._specs(input_args)
        self._expected_out = self._specs(output_args)
        self.grads: list[tf.Tensor | None] = []
        self._programs: dict[str, Callable] = {}
        self.clear_runtime_states()

    # -- bookkeeping -------------------------------------------------------------------------------
    @staticmethod
    def _specs(example: Any) -> tuple | None:
        if example is None:
            return None
        items = example if isinstance(example, (tuple, list)) else (example,)
        return tuple(_spec(t) for t in items)

    @property
    def trainable_variables(self) -> list[Any]:
        return list(self.submod.trainable_variables)

    def zero_grads(self) -> None:
        """Forgets the accumulated gradients."""
        self.grads = [None] * len(self.trainable_variables)

    def clear_runtime_states(self) -> None:
        """Drops the microbatch inputs, outputs and gradients kept by the last step (not ``grads``)."""
        self.inputs: dict[int, tuple] = {}
        self.keywords: dict[int, dict] = {}  # the first stage's keyword inputs per microbatch
        self.outputs: dict[int, Any] = {}
        self.output_grads: dict[int, Any] = {}
        self.input_grads: dict[int, tuple] = {}
        self.losses: dict[int, tf.Tensor] = {}
        self.targets: dict[int, Any] = {}
        self.output_chunks: list[Any] = []
        self._tapes: dict[int, tf.GradientTape] = {}  # per microbatch: the forward's saved activations
        self._weight_grads: dict[int, list] = {}  # computed by an I action, added by its W action
        # most microbatches held at once between forward and backward (what the schedule makes it keep):
        # their activations, or only their inputs with activation_checkpoint
        self.peak_held_inputs = 0
        if len(self.grads) != len(self.trainable_variables):
            self.zero_grads()

    def _check(self, tensors: tuple, expected: tuple | None, what: str, neighbour: str) -> tuple:
        got = tuple(_spec(t) for t in tensors)
        if expected is None:
            return got
        if len(got) != len(expected) or any(
            g[1] != e[1] or len(g[0]) != len(e[0]) or any(a is not None and b is not None and a != b
                                                         for a, b in zip(g[0], e[0]))
            for g, e in zip(got, expected)
        ):
            raise PipeliningShapeError(
                f"stage {self.stage_index} {what} {[(list(s), d) for s, d in got]}, but "
                f"{neighbour} expects {[(list(s), d) for s, d in expected]}."
            )
        return expected

    # -- placement ---------------------------------------------------------------------------------
    def place(self, t: Any) -> Any:
        """``t`` moved onto this stage's devices (replicated on a sub-mesh)."""
        with _EAGER_LOCK:
            return self._place(t)

    def _place(self, t: Any) -> Any:
        if isinstance(self.device, DeviceMesh):
            mesh = self.device.to_tf()
            if dtensor.is_dtensor(t) and dtensor.fetch_layout(t).mesh == mesh:
                return t
            return replicated_on(t, mesh)  # TF DTensor copies only replicated tensors between meshes
        if dtensor.is_dtensor(t):
            layout = dtensor.fetch_layout(t)
            if not layout.is_fully_replicated():
                t = dtensor.relayout(t, dtensor.Layout.replicated(layout.mesh, t.shape.rank))
            t = dtensor.unpack(t)[0]
        with tf.device(self.device):
            return tf.identity(t)

    # -- compiled programs ----------------------------------------------------------------------------
    def _program(self, name: str, build: Callable[[], Callable]) -> Callable:
        if name not in self._programs:
            self._programs[name] = tf.function(build(), autograph=False, reduce_retracing=True)
        return self._programs[name]

    def _run(self, fn: Callable, *args: Any) -> Any:
        if isinstance(self.device, DeviceMesh):
            return fn(*args)
        with tf.device(self.device):
            return fn(*args)

    def _forward(self) -> Callable:
        if not self.is_first:
            return lambda *xs, **kw: self.submod(*xs, **kw)
        # TF's backward program of a compiled call computes the gradient of every input it can
        # reach; the model's inputs need none (torch's first stage computes none either).
        return lambda *xs, **kw: self.submod(*(tf.stop_gradient(x) for x in xs),
                                             **{k: tf.stop_gradient(v) if tf.is_tensor(v) else v for k, v in kw.items()})

    def _place_keywords(self, kwargs: dict | None) -> dict:
        return {k: self.place(v) if tf.is_tensor(v) else v for k, v in (kwargs or {}).items()}

    def forward_one_chunk(self, microbatch: int, args: tuple, kwargs: dict | None = None) -> Any:
        """Runs the forward of one microbatch (``kwargs``: the model's keyword inputs, first stage);
        keeps what its backward needs (its activations, or only its inputs with ``activation_checkpoint``)."""
        args = tuple(self.place(a) for a in args)
        kwargs = self._place_keywords(kwargs)
        self._expected_in = self._check(args, self._expected_in, "receives",
                                        "its input_args" if self.stage_index == 0 else f"stage {self.stage_index}")
        fn = self._program("forward", self._forward)
        if self.activation_checkpoint or not self.record_for_backward:
            out = self._run(lambda: fn(*args, **kwargs))
        else:
            tape = tf.GradientTape()
            with tape:
                for a in () if self.is_first else args:  # the model's input needs no gradient
                    if a.dtype.is_floating or a.dtype.is_complex:
                        tape.watch(a)
                out = self._run(lambda: fn(*args, **kwargs))
            self._tapes[microbatch] = tape
        self.keywords[microbatch] = kwargs
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self._expected_out = self._check(tuple(outs), self._expected_out, "outputs", "its output_args")
        self.inputs[microbatch] = args
        self.outputs[microbatch] = out
        self.peak_held_inputs = max(self.peak_held_inputs, len(self.inputs))
        return out

    def compute_loss(self, microbatch: int, loss_fn: Callable, target: Any, loss_kwargs: dict | None = None) -> tf.Tensor:
        """The last stage's loss on one microbatch, ``loss_fn(output, target, **loss_kwargs)`` (kept for
        its backward)."""
        target = self.place(target) if target is not None else None
        loss_kwargs = self._place_keywords(loss_kwargs)
        fn = self._program("loss", lambda: lambda y, t, **kw: loss_fn(y, t, **kw))
        tape = self._tapes.get(microbatch)
        with tape if tape is not None else contextlib.nullcontext():  # joins the forward's record
            loss = self._run(lambda: fn(self.outputs[microbatch], target, **loss_kwargs))
        self.losses[microbatch], self.targets[microbatch] = loss, (target, loss_kwargs)
        return loss

    def _recompute(self, loss_fn: Callable | None) -> Callable:
        def backward(args, kwargs, target, dy, want_inputs: bool, want_weights: bool):
            variables = self.trainable_variables
            with tf.GradientTape() as tape:
                for a in args:
                    tape.watch(a)
                out = self.submod(*args, **kwargs)
                if loss_fn is not None:
                    out = loss_fn(out, target[0], **target[1])
            sources = (list(args) if want_inputs else []) + (variables if want_weights else [])
            grads = tape.gradient(out, sources, output_gradients=dy,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            n_in = len(args) if want_inputs else 0
            return grads[:n_in], grads[n_in:]
        return backward

    def backward_one_chunk(self, microbatch: int, loss_fn: Callable | None = None, *, inputs: bool = True,
                           weights: bool = True) -> None:
        """The backward of one microbatch: the full one, or only its input (``I``) or weight (``W``) part."""
        if microbatch not in self.inputs:
            raise RuntimeError(f"stage {self.stage_index}: backward of microbatch {microbatch} before its forward")
        last = self.is_last and loss_fn is not None
        if last:
            dy = None
        else:
            if microbatch not in self.output_grads:
                raise RuntimeError(f"stage {self.stage_index}: no output gradient for microbatch {microbatch}")
            dy = self.output_grads[microbatch]
        if microbatch in self._weight_grads:  # the W after an I that computed them
            d_in, d_w = (), self._weight_grads.pop(microbatch)
        elif microbatch in self._tapes:
            d_in, d_w = self._saved_backward(microbatch, self.losses[microbatch] if last else self.outputs[microbatch], dy)
            if not weights:
                self._weight_grads[microbatch] = d_w
        else:
            key = f"backward-{int(inputs)}{int(weights)}-{int(last)}"
            impl = self._recompute(loss_fn if last else None)
            fn = self._program(key, lambda: lambda a, kw, t, g: impl(a, kw, t, g, inputs, weights))
            d_in, d_w = self._run(fn, self.inputs[microbatch], self.keywords[microbatch],
                                  self.targets.get(microbatch) if last else None, dy)
        if inputs:
            self.input_grads[microbatch] = tuple(d_in)
        if weights:
            with _EAGER_LOCK:
                self.grads = [g if acc is None else acc + g for acc, g in zip(self.grads, d_w)]
            if inputs or microbatch in self.input_grads:
                self.inputs.pop(microbatch, None)
                self.keywords.pop(microbatch, None)

    def _saved_backward(self, microbatch: int, out: Any, dy: Any) -> tuple[list, list]:
        """Input and weight gradients of one microbatch from the activations its forward kept: TF's
        compiled backward program of the forward call, run once."""
        args = () if self.is_first else self.inputs[microbatch]
        tape = self._tapes.pop(microbatch)
        grads = self._run(lambda: tape.gradient(out, list(args) + self.trainable_variables, output_gradients=dy,
                                                unconnected_gradients=tf.UnconnectedGradients.ZERO))
        return grads[:len(args)], grads[len(args):]

    def scale_grads(self, divisor: int) -> None:
        if divisor != 1:
            with _EAGER_LOCK:
                self.grads = [None if g is None else g / divisor for g in self.grads]


def build_stage(stage_module: Any, stage_index: int, pipe_info: Any, device: Any,
                group: Any = None) -> PipelineStage:
    """A PipelineStage for one of a Pipe's stage modules, with the shapes ``pipe_info`` (a ``PipeInfo``)
    recorded (torch's ``torch.distributed.pipelining.stage.build_stage``).

    Example::

        stage = build_stage(pipe.get_stage_module(0), 0, pipe.info(), device="CPU:0")
    """
    return PipelineStage(stage_module, stage_index, pipe_info.num_stages, device,
                         input_args=pipe_info.stage_inputs[stage_index],
                         output_args=pipe_info.stage_outputs[stage_index], group=group)
