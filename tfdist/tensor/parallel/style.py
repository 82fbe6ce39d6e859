"""Tensor-parallel styles for Keras layers (torch.distributed.tensor.parallel.style).

A style lays out a layer's weights on the tensor-parallel mesh dim and
relayouts its inputs and outputs, so that TF DTensor runs the Megatron
pattern: ``ColwiseParallel`` shards output features (no communication in
the forward), ``RowwiseParallel`` shards input features (one all-reduce, or
a reduce-scatter with ``output_layouts=Shard(1)``), ``SequenceParallel``
shards the sequence dim of norms and dropout.

``use_local_output`` in TensorFlow: every activation is a TF DTensor -- a
``tf.Tensor`` that carries its layout, which Keras layers and TF ops take
as they are.  ``use_local_output=True`` returns that ``tf.Tensor``;
``use_local_output=False`` returns a tfdist ``DTensor`` wrapping it (its
placements visible, usable by tfdist code and, being tensor-like, by Keras
layers too).  The meaning is the same in every style.

Activations keep their data-parallel sharding: when the tensor-parallel
mesh is a slice (``mesh["tp"]``) of a 2-D mesh, dim 0 (the batch) stays
sharded on the other mesh dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.device_mesh import DeviceMesh
from tfdist.tensor._api import DTensor
from tfdist.tensor._layout import (
    DTensorSpec,
    normalize_placements,
    physical_layout,
    to_root_placements,
)
from tfdist.tensor._modules import LayerKind, ModuleBackend
from tfdist.tensor._redistribute import relayout
from tfdist.tensor.parallel import _partial_products
from tfdist.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
]


_BATCH_REPLICATED: contextvars.ContextVar[bool] = contextvars.ContextVar("tfdist_batch_replicated", default=False)


@contextlib.contextmanager
def replicated_batch() -> Iterator[None]:
    """Inside, styles keep activations' batch dim replicated instead of sharding it over the
    data-parallel mesh dim: for a batch that does not split evenly (the last partial batch
    of an epoch, ``predict`` on one sample), every data-parallel replica computes it whole --
    exactly one device's loss and gradients, with no padding."""
    token = _BATCH_REPLICATED.set(True)
    try:
        yield
    finally:
        _BATCH_REPLICATED.reset(token)


def batch_replicated() -> bool:
    """True inside ``replicated_batch()``: the batch is whole on every data-parallel replica."""
    return _BATCH_REPLICATED.get()


def on_mesh(x: tf.Tensor, mesh_tf: dtensor.Mesh) -> tf.Tensor:
    """An eager plain tensor copied onto the mesh (replicated); DTensors/graph tensors unchanged."""
    if tf.executing_eagerly() and not dtensor.is_dtensor(x):
        return dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh_tf, x.shape.rank))
    return x


def as_tf(x: Any) -> Any:
    """tfdist DTensor -> its TF DTensor; other values unchanged."""
    return x.to_tf() if isinstance(x, DTensor) else x


@dataclasses.dataclass(frozen=True)
class _Context:
    """Where a style applies: the TP mesh (1-D, maybe a slice), the batch mesh dim, the layer's framework."""

    mesh: DeviceMesh
    batch_axis: int | None
    fqn: str
    modules: ModuleBackend

    @property
    def root(self) -> DeviceMesh:
        return self.mesh.root_mesh

    def root_placements(self, placements: Sequence[Placement], rank: int) -> tuple[Placement, ...]:
        root = list(to_root_placements(self.mesh, normalize_placements(tuple(placements), self.mesh, rank)))
        if (
            self.batch_axis is not None and rank >= 1 and root[self.batch_axis].is_replicate()
            and not any(p.is_shard(0) for p in root) and not _BATCH_REPLICATED.get()
        ):
            root[self.batch_axis] = Shard(0)  # activations stay batch-sharded
        return tuple(root)

    def weight_layout(self, placements: Sequence[Placement]):
        def layout(rank: int) -> dtensor.Layout:
            root = to_root_placements(self.mesh, normalize_placements(tuple(placements), self.mesh, rank))
            return physical_layout(self.root, root, rank)

        return layout

    def layout_of(self, placements: Sequence[Placement], rank: int) -> dtensor.Layout:
        """The TF layout of an activation of ``rank`` dims with ``placements`` on the TP mesh."""
        return physical_layout(self.root, self.root_placements(placements, rank), rank)

    def to_layout(
        self, x: Any, placements: Sequence[Placement] | None, use_local_output: bool = True,
        arrives_as: Sequence[Placement] | None = None,
    ) -> Any:
        """Relayouts activation ``x`` to ``placements`` on the TP mesh (None: leave it).

        ``arrives_as`` is the layout the input is declared to have (a style's
        ``input_layouts``): the gradient goes back to it, as torch's backward
        of a redistribute does.  TF's own gradient of a relayout
        (``RelayoutLike``) leaves the layout to propagation, which TF DTensor
        2.21 gets wrong when the input also feeds a residual
        (docs/tf_dtensor_repros/rowwise_sequence_shard_output.py).
        """
        if placements is None or x is None or self.modules.is_symbolic(x):
            return x
        if _has_partial(arrives_as):
            # A TF tensor is its global value (as a DTensor is in torch, whose actual placements
            # win over input_layouts); only a tfdist DTensor holds per-device partial sums.
            arrives_as = None
        if isinstance(x, DTensor) and (x._spec.partial_mesh_dims or _has_partial(placements)):
            return self._redistribute(x, placements, use_local_output)
        if _has_partial(placements):
            raise ValueError(
                f"layer {self.fqn!r}: cannot lay a tensor out as {tuple(placements)!r}: a Partial comes from a "
                "product (RowwiseParallel(output_layouts=Partial(), use_local_output=False)), not from a "
                "relayout (tfdist refuses moves to Partial, as torch does from a Shard).")
        x = as_tf(x)
        if not isinstance(x, tf.Tensor):
            return x
        x = on_mesh(x, self.root.to_tf())
        rank = x.shape.rank
        root = self.root_placements(placements, rank)
        self._check_divisible(x.shape, root)
        layout = physical_layout(self.root, root, rank)
        if arrives_as is None or not x.dtype.is_floating:
            y = dtensor.relayout(x, layout)
        else:
            y = _relayout_with_gradient(x, layout, self.layout_of(arrives_as, rank))
        if use_local_output:
            return y
        spec = DTensorSpec(self.root, root, tuple(y.shape.as_list()))
        return DTensor._wrap(y, spec)

    def _check_divisible(self, shape: tf.TensorShape, root: Sequence[Placement]) -> None:
        for m, p in enumerate(root):
            if isinstance(p, Shard) and shape[p.dim] is not None and shape[p.dim] % self.root.shape[m]:
                raise ValueError(
                    f"layer {self.fqn!r}: dim {p.dim} of an activation of shape "
                    f"{tuple(shape)} is not divisible by mesh dim "
                    f"{self.root.axis_names[m]!r} ({self.root.shape[m]}); choose sizes "
                    "divisible by the tensor-parallel degree."
                )

    def _redistribute(self, x: DTensor, placements: Sequence[Placement], use_local_output: bool) -> Any:
        """A tfdist DTensor moved with torch's collectives: a Partial arriving is reduced straight
        into the layout the style wants (a reduce-scatter onto a shard, else an all-reduce) --
        never all-reduced first and sliced after, which ``to_tf`` would do."""
        rank = len(x.shape)
        root = self.root_placements(placements, rank)
        self._check_divisible(tf.TensorShape(x.shape), root)
        y = x.redistribute(self.root, root)
        if not use_local_output:
            return y
        if y._spec.partial_mesh_dims:
            raise ValueError(_PARTIAL_LOCAL_OUTPUT.format(where=f"layer {self.fqn!r}"))
        return y.to_tf()


_PARTIAL_LOCAL_OUTPUT = (
    "{where}: a Partial output needs use_local_output=False. torch's local tensor of a Partial is "
    "each rank's partial sum; a TF tensor holds one global value, which for a Partial exists only "
    "after the reduction. With use_local_output=False the next layer gets a tfdist DTensor whose "
    "per-device parts are the partial sums: a styled layer reduces it straight into its input "
    "layout (e.g. a reduce-scatter), any other op reads its sum."
)


def _has_partial(placements: Sequence[Placement] | None) -> bool:
    return any(isinstance(p, Partial) for p in placements or ())


def _relayout_with_gradient(x: tf.Tensor, layout: dtensor.Layout, grad_layout: dtensor.Layout) -> tf.Tensor:
    """``dtensor.relayout(x, layout)`` whose gradient is relayouted to ``grad_layout``."""

    @tf.custom_gradient
    def move(x):
        def grad(dy):
            # dy has the forward layout; go back one mesh dim at a time (see relayout)
            return relayout(dtensor.relayout(dy, layout), grad_layout, source=layout)

        return dtensor.relayout(x, layout), grad

    return move(x)


def _as_placements(layouts: Placement | Sequence[Placement] | None, default: Placement) -> tuple[Placement, ...]:
    if layouts is None:
        return (default,)
    if isinstance(layouts, Placement):
        return (layouts,)
    if isinstance(layouts, (list, tuple)) and all(isinstance(p, Placement) for p in layouts):
        return tuple(layouts)
    raise TypeError(
        "layouts must be a Placement (Shard(d), Replicate()) or a sequence of them, one per "
        f"mesh dim of the tensor-parallel mesh. Received: {layouts!r}"
    )


class ParallelStyle:
    """Base class: a style lays out one layer for tensor parallelism."""

    def _weights(self, layer: Any, ctx: _Context) -> dict[str, list[Placement]]:
        """Weight name -> placements on the TP mesh; raises for unsupported layers."""
        return {}

    def weight_placements(self, layer: Any, mesh: DeviceMesh, modules: ModuleBackend) -> dict[str, list[Placement]]:
        """Weight name -> the placements (on the 1-D ``mesh``) this style gives ``layer``'s weights.

        Example::

            ColwiseParallel().weight_placements(dense, mesh["tp"], modules)
            # {'kernel': [Shard(dim=1)], 'bias': [Shard(dim=0)]}
        """
        return self._weights(layer, _Context(mesh, None, modules.layer_name(layer), modules))

    def _validate(self, layer: Any, ctx: _Context) -> None:
        """Everything that can fail, checked before parallelize_module changes anything."""
        weights = self._weights(layer, ctx)
        if ctx.modules.is_built(layer):
            own = ctx.modules.weights(layer)
            for name, placements in weights.items():
                if name in own:
                    variable = own[name]
                    ctx.modules.check_layout(variable, ctx.weight_layout(placements)(len(variable.shape)))

    def _apply(self, layer: Any, ctx: _Context) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


def _unsupported(style: str, layer: Any, ctx: _Context, supported: str) -> TypeError:
    return TypeError(
        f"{style} does not support layer {ctx.fqn!r} of type {type(layer).__name__}; "
        f"it supports {supported}."
    )


def _contracted_letters(kind: LayerKind) -> list[str]:
    """Kernel dims an EinsumDense sums over (in the input and the kernel, not the output)."""
    inp, ker, out = kind.einsum_parts()
    return [c for c in ker if c in inp and c not in out]


def _bias_and_activation(ctx: _Context, layer: Any, kind: LayerKind, y: tf.Tensor) -> tf.Tensor:
    """The rest of a dense/einsum layer's formula after its product."""
    bias = ctx.modules.weights(layer).get("bias")
    if bias is not None:
        y = y + _partial_products.reads_as(bias, y.dtype)
    return kind.activation(y) if kind.activation is not None else y


class ColwiseParallel(ParallelStyle):
    """Shards a layer's output features (torch: ``Linear`` weight ``Shard(0)``).

    Keras ``Dense`` kernel ``[in, out]`` -> ``Shard(1)``, bias ``Shard(0)``;
    ``Embedding`` table ``[vocab, dim]`` -> ``Shard(1)``; ``EinsumDense`` ->
    the first kernel dim that appears in the output only (the heads of a
    ``MultiHeadAttention`` query/key/value projection).  The input, arriving
    as ``input_layouts`` (default ``Replicate()``; ``Shard(1)`` after
    sequence parallelism), is made ``Replicate``; the output is sharded on
    that feature dim (``output_layouts``, default ``Shard(-1)``).  No communication in the
    forward pass; the backward all-reduces the input gradient.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True) -> None:
        # input_layouts says how the input arrives (torch); it is moved to Replicate.
        self.input_layouts = _as_placements(input_layouts, Replicate())
        self.desired_input_layouts = (Replicate(),)
        self.output_layouts = None if output_layouts is None else _as_placements(output_layouts, Shard(-1))
        self.use_local_output = use_local_output
        if _has_partial(self.output_layouts):
            raise ValueError(
                "ColwiseParallel(output_layouts=...) cannot be Partial: the column-parallel output is "
                "a Shard of the features, and a Shard cannot become a Partial (torch's redistribute "
                f"refuses it too). Received: {self.output_layouts!r}"
            )

    def _plan(self, layer: Any, ctx: _Context) -> tuple[dict[str, list], tuple[Placement, ...]]:
        kind = ctx.modules.layer_kind(layer)
        if kind.kind == "einsum":
            inp, ker, out = kind.einsum_parts()
            free = [c for c in ker if c in out and c not in inp]
            if not free:
                raise _unsupported("ColwiseParallel", layer, ctx, "EinsumDense with an output feature dim")
            letter = free[0]
            weights = {"kernel": [Shard(ker.index(letter))]}
            if letter in kind.bias_axes:
                weights["bias"] = [Shard(kind.bias_axes.index(letter))]
            return weights, (Shard(out.index(letter) - len(out)),)
        if kind.kind == "embedding":
            return {"embeddings": [Shard(1)]}, (Shard(-1),)
        if kind.kind == "dense":
            weights = {"kernel": [Shard(1)], "bias": [Shard(0)]}
            if not kind.use_bias:
                del weights["bias"]
            return weights, (Shard(-1),)
        raise _unsupported("ColwiseParallel", layer, ctx, "Dense, EinsumDense, Embedding")

    def _weights(self, layer: Any, ctx: _Context) -> dict[str, list[Placement]]:
        return self._plan(layer, ctx)[0]

    def _apply(self, layer: Any, ctx: _Context) -> Any:
        weights, natural_out = self._plan(layer, ctx)
        for name, placements in weights.items():
            ctx.modules.set_weight_layout(layer, name, ctx.weight_layout(placements))
        out_layouts = self.output_layouts or natural_out
        product = self._gathered_equation(layer, ctx)
        # a sharded input is gathered inside the product (its gradient reduce-scattered back)
        desired = self.input_layouts if product is not None else self.desired_input_layouts
        if product is not None:
            self._gathered_call(layer, ctx, weights, *product)

        def before(args, kwargs):
            x = ctx.to_layout(args[0], desired, arrives_as=self.input_layouts)
            return (x,) + tuple(args[1:]), kwargs

        def after(outputs):
            return ctx.to_layout(outputs, out_layouts, self.use_local_output)

        ctx.modules.wrap_call(layer, before, after)
        return layer

    def _gathered_equation(self, layer: Any, ctx: _Context) -> tuple[str, str] | None:
        """(equation, sharded output letter) when the input arrives sharded and torch's
        backward (a reduce-scatter of the input gradient) can be written; else None."""
        if not any(isinstance(p, Shard) for p in self.input_layouts):
            return None
        kind = ctx.modules.layer_kind(layer)
        if not kind.plain:
            return None
        if kind.kind == "dense":
            return "dense", "n"
        if kind.kind == "einsum":
            inp, ker, out = kind.einsum_parts()
            free = [c for c in ker if c in out and c not in inp]
            if free and all(c in out or c in ker for c in inp) and all(c in inp or c in out for c in ker):
                return kind.equation, free[0]
        return None

    def _gathered_call(self, layer: Any, ctx: _Context, weights: dict, equation: str, letter: str) -> None:
        arrives_as = self.input_layouts
        kind = ctx.modules.layer_kind(layer)

        def call(original, inputs, *args, **kwargs):
            x = as_tf(inputs)
            if ctx.modules.is_symbolic(x):
                return original(inputs, *args, **kwargs)
            kernel = _partial_products.reads_as(ctx.modules.weights(layer)["kernel"], x.dtype)
            kernel_layout = ctx.weight_layout(weights["kernel"])(kernel.shape.rank)
            y = _partial_products.gathered_product(
                ctx, kind.equation_for(x.shape.rank), x, kernel, letter, arrives_as, kernel_layout)
            return _bias_and_activation(ctx, layer, kind, y)

        ctx.modules.replace_call(layer, call)


class RowwiseParallel(ParallelStyle):
    """Shards a layer's input features (torch: ``Linear`` weight ``Shard(1)``).

    Keras ``Dense`` kernel -> ``Shard(0)`` (bias replicated); ``EinsumDense``
    -> the first contracted kernel dim (the heads of a ``MultiHeadAttention``
    output projection); ``Embedding`` table -> ``Shard(0)`` (vocabulary):
    each device looks up the ids in its own rows.  The input, arriving as
    ``input_layouts`` (default ``Shard(-1)``), is made sharded on the
    contracted dim.  The output is ``output_layouts``: ``Replicate()`` (the
    default; one all-reduce) or a shard such as ``Shard(1)`` (torch's
    sequence parallelism): the local products are a Partial that is
    reduce-scattered onto that dim -- no all-reduce.  ``Partial()`` with
    ``use_local_output=False`` returns the unreduced products as a tfdist
    DTensor; the layer that consumes it reduces it into its own input layout.

    Example::

        parallelize_module(model, mesh["tp"], {
            "down": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
            "norm": SequenceParallel(),  # the Partial is reduce-scattered onto the sequence here
        })
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True) -> None:
        # input_layouts says how the input arrives (torch); it is moved to the
        # layer's contracted-dim shard.  Not given: it arrives there (torch's
        # Shard(-1) is that dim for a Linear; for an EinsumDense it is the
        # contracted dim, e.g. the heads of an attention output projection).
        self.input_layouts = _as_placements(input_layouts, Shard(-1))
        self._declared_input = input_layouts is not None
        self.output_layouts = _as_placements(output_layouts, Replicate())
        self.use_local_output = use_local_output
        partial = [p for p in self.output_layouts if isinstance(p, Partial)]
        if partial and partial[0].reduce_op != "sum":
            raise ValueError(
                "RowwiseParallel(output_layouts=Partial(...)): the row-parallel product is a "
                f"Partial('sum'); received {self.output_layouts!r}."
            )
        if partial and use_local_output:
            raise ValueError(_PARTIAL_LOCAL_OUTPUT.format(where="RowwiseParallel(output_layouts=Partial())"))

    def _plan(self, layer: Any, ctx: _Context) -> tuple[dict[str, list], tuple[Placement, ...]]:
        kind = ctx.modules.layer_kind(layer)
        if kind.kind == "einsum":
            inp, ker, out = kind.einsum_parts()
            contracted = _contracted_letters(kind)
            if not contracted:
                raise _unsupported("RowwiseParallel", layer, ctx, "EinsumDense with a contracted dim")
            letter = contracted[0]
            return {"kernel": [Shard(ker.index(letter))]}, (Shard(inp.index(letter) - len(inp)),)
        if kind.kind == "embedding":
            return {"embeddings": [Shard(0)]}, (Replicate(),)
        if kind.kind == "dense":
            return {"kernel": [Shard(0)]}, (Shard(-1),)
        raise _unsupported("RowwiseParallel", layer, ctx, "Dense, EinsumDense, Embedding")

    def _weights(self, layer: Any, ctx: _Context) -> dict[str, list[Placement]]:
        return self._plan(layer, ctx)[0]

    def _validate(self, layer: Any, ctx: _Context) -> None:
        super()._validate(layer, ctx)
        extended_by = ctx.modules.layer_kind(layer).extended_by
        kind = ctx.modules.layer_kind(layer)
        if _has_partial(self.output_layouts) and getattr(kind.activation, "__name__", "linear") != "linear":
            raise ValueError(
                f"RowwiseParallel(output_layouts=Partial()) on layer {ctx.fqn!r}: the layer applies the "
                f"activation {kind.activation.__name__!r} to its output, which is not defined on "
                "partial sums; use output_layouts=Replicate() or a Shard, or a linear layer."
            )
        if self._reduces_explicitly(layer, ctx) and extended_by:
            raise ValueError(
                f"RowwiseParallel(output_layouts={self.output_layouts!r}) on layer {ctx.fqn!r}: "
                f"the layer has {extended_by}, which the "
                "reduce-scattered row-parallel product does not cover; use output_layouts=Replicate()."
            )

    def _reduces_explicitly(self, layer: Any, ctx: _Context) -> bool:
        """Computed as a Partial and reduced by tfdist (else TF's in-op all-reduce)."""
        kind = ctx.modules.layer_kind(layer).kind
        return kind == "embedding" or any(isinstance(p, (Shard, Partial)) for p in self.output_layouts)

    def _apply(self, layer: Any, ctx: _Context) -> Any:
        weights, in_layouts = self._plan(layer, ctx)
        for name, placements in weights.items():
            ctx.modules.set_weight_layout(layer, name, ctx.weight_layout(placements))
        if self._reduces_explicitly(layer, ctx):
            self._partial_call(layer, ctx, weights, in_layouts)

        def before(args, kwargs):
            arrives = self.input_layouts if self._declared_input else in_layouts
            x = ctx.to_layout(args[0], in_layouts, arrives_as=arrives)
            return (x,) + tuple(args[1:]), kwargs

        def after(outputs):
            return ctx.to_layout(outputs, self.output_layouts, self.use_local_output)

        ctx.modules.wrap_call(layer, before, after)
        return layer

    def _partial_call(self, layer: Any, ctx: _Context, weights: dict, in_layouts: tuple) -> None:
        """The layer's call as a local (Partial) product reduced straight into ``output_layouts``."""
        kind = ctx.modules.layer_kind(layer)
        out_layouts = self.output_layouts

        def call(original, inputs, *args, **kwargs):
            x = as_tf(inputs)
            if ctx.modules.is_symbolic(x):
                return original(inputs, *args, **kwargs)
            if kind.kind == "embedding":
                table = ctx.modules.weights(layer)["embeddings"]
                stacked = tf.cast(_partial_products.partial_lookup(ctx, x, tf.convert_to_tensor(table)),
                                  kind.compute_dtype)
                if _has_partial(out_layouts):
                    return _as_partial_dtensor(ctx, stacked)
                return _partial_products.resolve_partial(ctx, stacked, out_layouts)
            kernel = _partial_products.reads_as(ctx.modules.weights(layer)["kernel"], x.dtype)
            rank = x.shape.rank
            letter = _contracted_letters(kind)[0] if kind.kind == "einsum" else "k"
            x_specs = ctx.layout_of(in_layouts, rank).sharding_specs
            k_specs = ctx.weight_layout(weights["kernel"])(kernel.shape.rank).sharding_specs
            stacked = _partial_products.partial_einsum(
                ctx, kind.equation_for(rank), x, kernel, letter, x_specs, k_specs)
            if _has_partial(out_layouts):
                return _as_partial_dtensor(ctx, _partial_products.add_bias_once(
                    ctx, stacked, ctx.modules.weights(layer).get("bias")))
            y = _partial_products.resolve_partial(ctx, stacked, out_layouts)
            return _bias_and_activation(ctx, layer, kind, y)

        ctx.modules.replace_call(layer, call)


def _as_partial_dtensor(ctx: _Context, stacked: tf.Tensor) -> DTensor:
    """The stacked ``[T, *shape]`` partial products as the tfdist DTensor they are physically:
    ``Partial("sum")`` on the tensor-parallel mesh dim (no collective)."""
    rank = stacked.shape.rank - 1
    root = ctx.root_placements([Partial("sum")], rank)
    return DTensor._wrap(stacked, DTensorSpec(ctx.root, root, tuple(stacked.shape.as_list()[1:])))


class SequenceParallel(ParallelStyle):
    """Shards the sequence dim through norms and dropout (weights replicated).

    For ``LayerNormalization``, ``RMSNormalization`` and ``Dropout``: input
    and output are ``Shard(sequence_dim)``.  ``use_local_output=False``
    (torch's default) returns a tfdist DTensor.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _weights(self, layer: Any, ctx: _Context) -> dict[str, list[Placement]]:
        if ctx.modules.layer_kind(layer).kind not in ("norm", "dropout"):
            raise _unsupported("SequenceParallel", layer, ctx, "LayerNormalization, RMSNormalization, Dropout")
        return {}  # weights stay replicated

    def _apply(self, layer: Any, ctx: _Context) -> Any:
        self._weights(layer, ctx)
        placements = (Shard(self.sequence_dim),)

        def before(args, kwargs):
            return (ctx.to_layout(args[0], placements, arrives_as=placements),) + tuple(args[1:]), kwargs

        def after(outputs):
            return ctx.to_layout(outputs, placements, self.use_local_output)

        ctx.modules.wrap_call(layer, before, after)
        return layer


def _per_arg(layouts) -> tuple:
    if layouts is None:
        return ()
    if isinstance(layouts, Placement):
        return (layouts,)
    return tuple(layouts)


class PrepareModuleInput(ParallelStyle):
    """Relayouts a layer's inputs (positional and keyword) to desired layouts.

    ``input_layouts``/``desired_input_layouts`` have one entry per
    positional input (``None`` leaves that input alone); the kwarg
    variants are dicts by argument name.
    """

    def __init__(
        self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
        desired_input_kwarg_layouts=None, use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _per_arg(input_layouts)
        self.desired_input_layouts = _per_arg(desired_input_layouts)
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError(
                "input_layouts and desired_input_layouts need one entry per input; "
                f"Received {len(self.input_layouts)} and {len(self.desired_input_layouts)}."
            )
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                "input_kwarg_layouts and desired_input_kwarg_layouts need the same keys. "
                f"Received {sorted(self.input_kwarg_layouts)} and {sorted(self.desired_input_kwarg_layouts)}."
            )
        self.use_local_output = use_local_output

    def _apply(self, layer: Any, ctx: _Context) -> Any:
        def before(args, kwargs):
            done: dict[tuple, Any] = {}  # one relayout per tensor: q and kv are often the same tensor

            def prepare(x, given, desired):
                if desired is None:
                    return x
                want = _as_placements(desired, Replicate())
                key = (id(x), want)
                if key not in done:
                    arrives = None if given is None else _as_placements(given, Replicate())
                    done[key] = (x, ctx.to_layout(x, want, self.use_local_output, arrives_as=arrives))
                return done[key][1]

            args = list(args)
            for i, (given, desired) in enumerate(zip(self.input_layouts, self.desired_input_layouts)):
                if i < len(args):
                    args[i] = prepare(args[i], given, desired)
            for name, desired in self.desired_input_kwarg_layouts.items():
                if name in kwargs:
                    kwargs[name] = prepare(kwargs[name], self.input_kwarg_layouts[name], desired)
            return tuple(args), kwargs

        ctx.modules.wrap_call(layer, before, None)
        return layer


class PrepareModuleOutput(ParallelStyle):
    """Relayouts a layer's output(s) to ``desired_output_layouts``."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True) -> None:
        self.output_layouts = _per_arg(output_layouts)
        self.desired_output_layouts = _per_arg(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                "output_layouts and desired_output_layouts need one entry per output; "
                f"Received {len(self.output_layouts)} and {len(self.desired_output_layouts)}."
            )
        self.use_local_output = use_local_output

    def _apply(self, layer: Any, ctx: _Context) -> Any:
        def after(outputs):
            single = not isinstance(outputs, (list, tuple))
            outs = [outputs] if single else list(outputs)
            for i, desired in enumerate(self.desired_output_layouts):
                if i < len(outs) and desired is not None:
                    outs[i] = ctx.to_layout(outs[i], _as_placements(desired, Replicate()), self.use_local_output)
            return outs[0] if single else type(outputs)(outs)

        ctx.modules.wrap_call(layer, None, after)
        return layer
