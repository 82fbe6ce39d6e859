"""Automatic splitting: ``pipeline``, ``SplitPoint``, ``pipe_split``, ``Pipe`` (torch.distributed.pipelining).

torch traces a module into an FX graph and cuts it.  Keras has its own
graph: a functional model is one, and a subclassed model whose ``call`` uses
Keras layers and ``keras.ops`` becomes one when ``call`` runs on symbolic
``keras.Input`` s.  ``pipeline`` orders that graph's calls (Keras's own
execution order), cuts it at the split points, and gives each stage a module
that runs its calls on the *same* layer objects (weights shared, their paths
unchanged, so tensor-parallel plans and checkpoints keyed by path still
apply).  A tensor made before a cut and used after it (a skip connection)
becomes an output of every stage in between and an input of the next, as in
torch's split.  A ``Sequential`` model is cut into ``Sequential`` s.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfdist.pipelining import _graph_split
from tfdist.pipelining.stage import PipelineStage, build_stage

__all__ = ["SplitPoint", "pipe_split", "pipeline", "Pipe", "PipeInfo", "build_stage"]


class SplitPoint(enum.Enum):
    """Where to cut relative to a layer: before it runs (``BEGINNING``) or after (``END``)."""

    BEGINNING = 1
    END = 2


class PipeSplit(keras.layers.Layer):
    """A stage boundary in a Sequential model, or on a tensor in a ``call``; the identity when the model runs whole."""

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape


def pipe_split(name: str | None = None) -> PipeSplit:
    """A marker layer at which :func:`pipeline` cuts (torch's ``pipe_split()``).

    Example::

        model = keras.Sequential([keras.Input((8,)), dense1, pipe_split(), dense2])
        pipeline(model, (x_microbatch,)).num_stages   # 2

        class Net(keras.Model):                       # in a call: mark the tensor that crosses
            def call(self, x):
                return self.dense2(pipe_split()(self.dense1(x)))
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


def _sequential_cut(module: keras.Sequential, starts: set[int]) -> list[keras.Sequential]:
    layers = list(module.layers)
    cuts = sorted(s for s in starts if 0 < s < len(layers))
    groups = [[layer for layer in layers[lo:hi] if not isinstance(layer, PipeSplit)]
              for lo, hi in zip([0] + cuts, cuts + [len(layers)])]
    return [keras.Sequential(group) for group in groups if group]


def _graph_cut(graph: keras.Function, nodes: list[Any], starts: set[int], keywords: dict[str, Any]) -> list[Any]:
    def markers_only(lo: int, hi: int) -> bool:
        return all(isinstance(n.operation, PipeSplit) for n in nodes[lo:hi])

    cuts = sorted(s for s in starts if 0 < s < len(nodes))
    # a stage of nothing but markers would compute nothing: drop the cut that makes it
    cuts = [lo for lo, hi in zip(cuts, cuts[1:] + [len(nodes)]) if not markers_only(lo, hi)]
    if cuts and markers_only(0, cuts[0]):
        cuts = cuts[1:]
    return _graph_split.cut(graph, nodes, cuts, keywords)


def _is_array(v: Any) -> bool:
    return tf.is_tensor(v) or hasattr(v, "__array__") and not isinstance(v, (str, bytes))


def _layer_named(name: str, module: Any, layers: list[Any]) -> Any:
    """The layer ``name`` means: a layer name or path, or torch's attribute form (``layers.1``, ``blocks.0``)."""
    for layer in layers:
        if name in (layer.name, getattr(layer, "path", None)):
            return layer
    target: Any = module
    for part in name.split("."):
        if part == "layers" and target is module:
            target = layers  # torch's ModuleList "layers.N": the model's N-th layer
        elif part.isdigit() and isinstance(target, (list, tuple)) and int(part) < len(target):
            target = target[int(part)]
        else:
            target = getattr(target, part, None)
    if any(target is layer for layer in layers):
        return target
    raise ValueError(f"split_spec: {name!r} names no layer of the model; its layers are "
                     f"{[layer.name for layer in layers]}.")


def _starts(module: Any, layers: list[Any], first_index: dict[int, int], split_spec: dict | None,
            split_policy: Callable | None) -> set[int]:
    """The positions new stages start at, from split_spec and split_policy."""
    starts: set[int] = set()
    for name, point in (split_spec or {}).items():
        if not isinstance(point, SplitPoint):
            raise ValueError(f"split_spec[{name!r}] must be a SplitPoint. Received: {point!r}")
        layer = _layer_named(name, module, layers)
        i = first_index[id(layer)]
        starts.add(i if point == SplitPoint.BEGINNING else i + 1)
    if split_policy is not None:
        starts.update(first_index[id(layers[int(i)])] for i in split_policy(layers))
    return starts


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
        self.has_loss_and_backward = False  # the loss is the schedule's loss_fn, not part of the pipe
        self.loss_spec = None

    @property
    def split_gm(self) -> Any:
        """torch's split ``GraphModule``: here an object whose ``submod_<i>`` is stage ``i``'s Keras
        model (``pipe.split_gm.submod_0``), as torch names the submodules it cut."""
        return types.SimpleNamespace(**{f"submod_{i}": m for i, m in enumerate(self._modules)})

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
    """Cuts a Keras model into pipeline stages (torch's ``pipeline``).

    Sequential, functional and subclassed models whose ``call`` uses Keras
    layers and ``keras.ops`` are cut; skip connections across a cut are passed
    through the stages in between.

    Args:
        module: the model.
        mb_args: one microbatch of inputs (traces the model and records each
            stage's input and output shapes).
        mb_kwargs: one microbatch of the model's keyword inputs (a subclassed
            model's ``call(x, mask=...)``): the first stage takes them by name,
            as ``schedule.step(x, mask=m)`` passes them; a later stage that
            uses one receives it across the cut. Values that are not tensors
            are constants of the trace.
        split_spec: ``{layer: SplitPoint}``, the layer named by its name, its
            path, or torch's attribute form (``"layers.3"``, ``"blocks.0"``).
        split_policy: a function from the model's layers (in the order they
            run) to the indices of the layers new stages start at.

    ``pipe_split()`` markers in the model also cut it: a marker layer in a
    Sequential model, or ``x = pipe_split()(x)`` in a ``call`` (torch's bare
    ``pipe_split()`` statement needs a tensor to mark in Keras).

    Example::

        pipe = pipeline(model, (x[:4],), split_spec={"blocks.2": SplitPoint.BEGINNING})
        stage = pipe.build_stage(1, device="CPU:2")
    """
    if mb_kwargs is not None and not isinstance(mb_kwargs, dict):
        raise TypeError(f"pipeline: mb_kwargs must be a dict of keyword inputs. Received: mb_kwargs={mb_kwargs!r}")
    mb_kwargs = {k: tf.convert_to_tensor(v) if _is_array(v) else v for k, v in (mb_kwargs or {}).items()}
    if not isinstance(module, keras.layers.Layer):
        raise TypeError(f"pipeline: module must be a Keras model. Received: a {type(module).__name__}")
    x = tuple(tf.convert_to_tensor(a) for a in mb_args)
    keywords: dict[str, Any] = {}
    if isinstance(module, keras.Sequential):
        if mb_kwargs:
            raise ValueError(f"pipeline: mb_kwargs={sorted(mb_kwargs)} given for a Sequential model, which takes "
                             "one positional input.")
        layers = list(module.layers)
        starts = _starts(module, layers, {id(layer): i for i, layer in enumerate(layers)}, split_spec, split_policy)
        starts |= {i for i, layer in enumerate(layers) if isinstance(layer, PipeSplit)}
        modules = _sequential_cut(module, starts)
    else:
        graph, keywords = _graph_split.trace(module, x, mb_kwargs)
        nodes = _graph_split.ordered_nodes(graph)
        first_index: dict[int, int] = {}
        for i, node in enumerate(nodes):
            first_index.setdefault(id(node.operation), i)
        layers = list({id(n.operation): n.operation for n in nodes
                       if isinstance(n.operation, keras.layers.Layer)}.values())
        starts = _starts(module, layers, first_index, split_spec, split_policy)
        starts |= {i + 1 for i, node in enumerate(nodes) if isinstance(node.operation, PipeSplit)}
        modules = _graph_cut(graph, nodes, starts, keywords)
    if len(modules) < 2:
        raise ValueError("pipeline: the split points leave a single stage; name at least one layer in split_spec "
                         "or add a pipe_split() marker.")
    inputs, outputs = [], []
    for k, stage in enumerate(modules):
        y = stage(*x, **({name: mb_kwargs[name] for name in keywords} if k == 0 else {}))
        ys = tuple(y) if isinstance(y, (tuple, list)) else (y,)
        inputs.append(tuple(tf.TensorSpec(a.shape, a.dtype) for a in x))
        outputs.append(tuple(tf.TensorSpec(a.shape, a.dtype) for a in ys))
        x = ys
    return Pipe(modules, PipeInfo(len(modules), inputs, outputs))
