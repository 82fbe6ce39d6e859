"""Cutting a Keras graph into pipeline stages (what torch's ``split_module`` does to an FX graph).

A functional model is a Keras graph already; a subclassed model becomes one
when its ``call`` runs on symbolic ``keras.Input`` s, which works when ``call``
uses Keras layers and ``keras.ops`` (each call records a node).  The nodes
are put in Keras's own execution order (deepest first, as
``Functional._run_through_graph`` runs them), so every cut of that list is a
valid split: a node's inputs come from its own stage or an earlier one.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

__all__ = ["trace", "ordered_nodes", "GraphStage", "cut"]


def _symbolic(a: Any) -> Any:
    return keras.Input(batch_shape=tuple(a.shape), dtype=a.dtype.name)


def trace(module: Any, mb_args: tuple, mb_kwargs: dict | None = None) -> tuple[keras.Function, dict[str, Any]]:
    """The Keras graph of ``module`` called on one microbatch's shapes, and its keyword inputs.

    Tensor keyword inputs become graph inputs after the positional ones (the
    returned dict maps each name to its symbolic input); any other keyword
    value is a constant of the trace, as torch's tracer treats it.
    """
    mb_kwargs = mb_kwargs or {}
    if isinstance(module, keras.Function):  # a functional model
        if mb_kwargs:
            raise ValueError(f"pipeline: mb_kwargs={sorted(mb_kwargs)} given for a functional model, whose inputs "
                             "are positional; pass them in mb_args in the order of model.inputs.")
        return module, {}
    if not module.built:
        module(*mb_args, **mb_kwargs)  # make the weights outside the symbolic trace
    symbolic = [_symbolic(a) for a in mb_args]
    keywords = {k: _symbolic(v) for k, v in mb_kwargs.items() if tf.is_tensor(v)}
    try:
        outputs = module.call(*symbolic, **{**mb_kwargs, **keywords})
        return keras.Function(symbolic + list(keywords.values()), outputs), keywords
    except Exception as e:  # noqa: BLE001 - re-raised with what to do about it
        raise TypeError(
            f"pipeline: {type(module).__name__}.call could not be traced with symbolic Keras inputs ({e}). "
            "pipeline() cuts models whose call uses Keras layers and keras.ops (not tf.* functions); "
            "use keras.ops in call or wrap TensorFlow functions in a Layer, or build PipelineStage objects by hand."
        ) from e


def ordered_nodes(graph: keras.Function) -> list[Any]:
    """The graph's call nodes in the order Keras runs them."""
    nodes = []
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        nodes += [n for n in graph._nodes_by_depth[depth] if n.operation is not None and not n.is_input]
    return nodes


class _Nodes:
    """A plain holder, so Keras's attribute tracking leaves the node list alone."""

    def __init__(self, nodes: list[Any], inputs: list[Any], outputs: list[Any], keywords: dict[str, Any]) -> None:
        self.nodes, self.inputs, self.outputs, self.keywords = nodes, inputs, outputs, keywords


class GraphStage(keras.Model):
    """One stage of a cut graph: runs its nodes, on the original layer objects, in the model's order.

    Its inputs are the tensors live at the cut before it (the model's inputs
    for the first stage), its outputs the tensors live at the cut after it
    (the model's outputs for the last stage); a single one is returned bare.
    The first stage also takes the model's tensor keyword inputs by name
    (``keywords``); later stages receive any of them they use positionally,
    as tensors that crossed the cut.
    """

    def __init__(self, nodes: list[Any], inputs: list[Any], outputs: list[Any], name: str,
                 keywords: dict[str, Any] | None = None) -> None:
        super().__init__(name=name)
        keywords = keywords or {}
        positional = [t for t in inputs if all(t is not k for k in keywords.values())]
        self._graph = _Nodes(nodes, positional, outputs, keywords)
        layers = [n.operation for n in nodes if isinstance(n.operation, keras.layers.Layer)]
        self.stage_layers = list(dict.fromkeys(layers))  # tracked: the stage's trainable_variables
        self.built = True

    def call(self, *inputs: Any, **kwargs: Any) -> Any:
        if set(kwargs) != set(self._graph.keywords):
            raise TypeError(f"{self.name}: takes the keyword inputs {sorted(self._graph.keywords)} (the tensors "
                            f"pipeline() was given in mb_kwargs). Received: {sorted(kwargs)}")
        values = {id(t): x for t, x in zip(self._graph.inputs, inputs)}
        values.update({id(t): kwargs[k] for k, t in self._graph.keywords.items()})
        for node in self._graph.nodes:
            args, kwargs = node.arguments.fill_in(values)
            out = node.operation(*args, **kwargs)
            for t, y in zip(node.outputs, keras.tree.flatten(out)):
                values[id(t)] = y
        outs = tuple(values[id(t)] for t in self._graph.outputs)
        return outs[0] if len(outs) == 1 else outs


def _live(tensors: list[Any], made_at: dict[int, int], last_use: dict[int, int], boundary: int) -> list[Any]:
    """The tensors made before ``boundary`` and used at or after it: what crosses that cut."""
    return [t for t in tensors if made_at[id(t)] < boundary <= last_use.get(id(t), -1)]


def cut(graph: keras.Function, nodes: list[Any], starts: list[int],
        keywords: dict[str, Any] | None = None) -> list[GraphStage]:
    """Stage modules for ``nodes`` cut before each index in ``starts`` (sorted, in (0, len(nodes)));
    ``keywords`` are the graph inputs the first stage takes by name."""
    bounds = [0] + starts + [len(nodes)]
    stage_of = {}
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        for node in nodes[lo:hi]:
            if stage_of.setdefault(node.operation, k) != k:
                raise ValueError(
                    f"pipeline: layer {node.operation.name!r} is called in stages {stage_of[node.operation]} and "
                    f"{k}; a layer's weights live on one stage. Move the split points so its calls share a stage."
                )
    inputs, outputs = keras.tree.flatten(graph.inputs), keras.tree.flatten(graph.outputs)
    made_at = {id(t): -1 for t in inputs}
    last_use = {id(t): len(nodes) for t in outputs}  # the model's outputs live to the end
    tensors = list(inputs)
    for i, node in enumerate(nodes):
        for t in node.arguments.keras_tensors:
            last_use[id(t)] = max(last_use.get(id(t), -1), i)
        for t in node.outputs:
            made_at[id(t)] = i
            tensors.append(t)
    stages = []
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        ins = inputs if k == 0 else _live(tensors, made_at, last_use, lo)
        outs = outputs if hi == len(nodes) else _live(tensors, made_at, last_use, hi)
        stages.append(GraphStage(nodes[lo:hi], ins, outs, name=f"stage_{k}", keywords=keywords if k == 0 else None))
    return stages

