"""Automatic splitting: ``pipeline``, ``SplitPoint``, ``pipe_split``, ``Pipe`` (torch.distributed.pipelining).

torch traces a module into an FX graph and cuts it.  Keras has no such
tracer, but a ``Sequential`` model, and a functional model whose layers form
a chain, are already their graph: ``pipeline`` cuts the layer list at the
split points and gives each stage a ``Sequential`` of the *same* layer objects
(weights shared, and the weights' paths unchanged, so tensor-parallel plans
and checkpoints keyed by path still apply).  A subclassed model's ``call`` is
Python: build its stages with ``PipelineStage`` directly.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfdist.pipelining.stage import PipelineStage

__all__ = ["SplitPoint", "pipe_split", "pipeline", "Pipe", "PipeInfo", "build_stage"]


class SplitPoint(enum.Enum):
    """Where to cut relative to a layer: before it runs (``BEGINNING``) or after (``END``)."""

    BEGINNING = 1
    END = 2


class PipeSplit(keras.layers.Layer):
    """A stage boundary inside a Sequential or functional model; the identity when the model runs whole."""

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape


def pipe_split(name: str | None = None) -> PipeSplit:
    """A marker layer at which :func:`pipeline` cuts (torch's ``pipe_split()``).

    Example::

        model = keras.Sequential([keras.Input((8,)), dense1, pipe_split(), dense2])
        pipeline(model, (x_microbatch,)).num_stages   # 2
    """
    return PipeSplit(name=name)


@dataclasses.dataclass
class PipeInfo:
    """What building a stage needs to know: the number of stages and each stage's input and output
    (shape, dtype) for one microbatch."""

    num_stages: int
    stage_inputs: list[tuple[tf.TensorSpec, ...]]
    stage_outputs: list[tuple[tf.TensorSpec, ...]]
    has_loss_and_backward: bool = False


def _chain(module: Any) -> list[Any]:
    if isinstance(module, keras.Sequential):
        return list(module.layers)
    if isinstance(module, keras.Model) and type(module).__name__ == "Functional":
        layers = [layer for layer in module.layers if not isinstance(layer, keras.layers.InputLayer)]
        previous = None
        for layer in layers:
            inbound = [t._keras_history[0] for node in layer._inbound_nodes for t in node.input_tensors]
            sources = [x for x in inbound if not isinstance(x, keras.layers.InputLayer)]
            if len(layer._inbound_nodes) != 1 or (previous is None and sources) or \
                    (previous is not None and sources != [previous]):
                raise ValueError(
                    f"pipeline: layer {layer.name!r} of the functional model does not take (only) the previous "
                    "layer's output; pipeline() cuts chains of layers. Build PipelineStage objects by hand."
                )
            previous = layer
        return layers
    raise TypeError(
        "pipeline: module must be a keras.Sequential or a functional keras.Model whose layers form a chain; "
        f"received a {type(module).__name__}. For a subclassed model build PipelineStage objects by hand."
    )


def _index_of(name: str, layers: list[Any]) -> int:
    names = [layer.name for layer in layers]
    if name in names:
        return names.index(name)
    m = re.fullmatch(r"(?:layers\.)?(\d+)", name)  # torch's FQN form: "layers.1"
    if m and int(m.group(1)) < len(layers):
        return int(m.group(1))
    raise ValueError(f"split_spec: {name!r} names no layer of the model; its layers are {names}.")


class Pipe:
    """The stages ``pipeline`` cut a model into.

    Example::

        pipe = pipeline(model, (x[:4],), split_spec={"dense_2": SplitPoint.BEGINNING})
        stage = pipe.build_stage(1, device="CPU:2")
    """

    def __init__(self, stage_modules: list[Any], info: PipeInfo) -> None:
        self._modules = stage_modules
        self._info = info
        self.num_stages = len(stage_modules)
        self.has_loss_and_backward = False

    def get_stage_module(self, stage_idx: int) -> Any:
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"stage_idx must be in [0, {self.num_stages}). Received: stage_idx={stage_idx!r}")
        return self._modules[stage_idx]

    def info(self) -> PipeInfo:
        return self._info

    def build_stage(self, stage_index: int, device: Any, group: Any = None) -> PipelineStage:
        return build_stage(self.get_stage_module(stage_index), stage_index, self._info, device, group)

    def __repr__(self) -> str:
        lines = [f"Pipe({self.num_stages} stages)"]
        for i, m in enumerate(self._modules):
            ins = [list(s.shape) for s in self._info.stage_inputs[i]]
            outs = [list(s.shape) for s in self._info.stage_outputs[i]]
            lines.append(f"  stage {i}: {[layer.name for layer in m.layers]} {ins} -> {outs}")
        return "\n".join(lines)


def pipeline(module: Any, mb_args: tuple, mb_kwargs: dict | None = None,
             split_spec: dict[str, SplitPoint] | None = None,
             split_policy: Callable[[list[Any]], Sequence[int]] | None = None) -> Pipe:
    """Cuts a Sequential or chain-shaped functional model into stages.

    Args:
        module: the model.
        mb_args: one microbatch of inputs (builds the stages and records each
            stage's input and output shapes).
        split_spec: ``{layer name (or "layers.N"): SplitPoint}``.
        split_policy: a function from the model's layer list to the indices
            of the layers each new stage starts at (instead of ``split_spec``).

    ``pipe_split()`` marker layers in the model also cut it.

    Example::

        pipe = pipeline(model, (x[:4],), split_spec={"block2": SplitPoint.BEGINNING,
                                                     "block3": SplitPoint.END})
    """
    if mb_kwargs:
        raise ValueError("pipeline: keyword inputs are not supported; pass the microbatch in mb_args.")
    layers = _chain(module)
    starts: set[int] = set()
    for name, point in (split_spec or {}).items():
        if not isinstance(point, SplitPoint):
            raise ValueError(f"split_spec[{name!r}] must be a SplitPoint. Received: {point!r}")
        i = _index_of(name, layers)
        starts.add(i if point == SplitPoint.BEGINNING else i + 1)
    if split_policy is not None:
        starts.update(int(i) for i in split_policy(layers))
    for i, layer in enumerate(layers):
        if isinstance(layer, PipeSplit):
            starts.add(i)
    cuts = sorted(s for s in starts if 0 < s < len(layers))
    groups, begin = [], 0
    for cut in cuts + [len(layers)]:
        group = [layer for layer in layers[begin:cut] if not isinstance(layer, PipeSplit)]
        if group:
            groups.append(group)
        begin = cut
    if len(groups) < 2:
        raise ValueError("pipeline: the split points leave a single stage; name at least one layer in split_spec "
                         "or add a pipe_split() layer.")
    modules, inputs, outputs = [], [], []
    x = tuple(tf.convert_to_tensor(a) for a in mb_args)
    for group in groups:
        stage = keras.Sequential(group)
        y = stage(*x)
        ys = y if isinstance(y, (tuple, list)) else (y,)
        inputs.append(tuple(tf.TensorSpec(a.shape, a.dtype) for a in x))
        outputs.append(tuple(tf.TensorSpec(a.shape, a.dtype) for a in ys))
        modules.append(stage)
        x = tuple(ys)
    return Pipe(modules, PipeInfo(len(modules), inputs, outputs))


def build_stage(stage_module: Any, stage_index: int, pipe_info: PipeInfo, device: Any,
                group: Any = None) -> PipelineStage:
    """A PipelineStage for one of a Pipe's stage modules, with the shapes ``pipe_info`` recorded.

    Example::

        stage = build_stage(pipe.get_stage_module(0), 0, pipe.info(), device="CPU:0")
    """
    return PipelineStage(stage_module, stage_index, pipe_info.num_stages, device,
                         input_args=pipe_info.stage_inputs[stage_index],
                         output_args=pipe_info.stage_outputs[stage_index], group=group)
