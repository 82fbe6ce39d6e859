"""GPT: a small decoder in stock Keras 3 layers, its TP plan and the TP x DP recipe.

Token + position embeddings, N blocks of causal self-attention and MLP with
pre-layer-norm, a final norm and an LM head.  ``parallelize_gpt`` is the
recipe, torchtitan-style: tensor parallel on ``mesh["tp"]``, batches on "dp".
"""

from __future__ import annotations

from typing import Any

import keras

from tfdist.device_mesh import DeviceMesh
from tfdist.models.mlp import MLP
from tfdist.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from tfdist.tensor.placement_types import Replicate, Shard

__all__ = ["GPT", "GPTStage", "gpt_tp_plan", "parallelize_gpt", "split_gpt"]


class PositionEmbedding(keras.layers.Layer):
    """Learned absolute positions added to the input."""

    def __init__(self, max_len: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_len = max_len

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.max_len, input_shape[-1]), initializer="glorot_uniform", name="embeddings"
        )

    def call(self, x):
        return x + self.embeddings[: x.shape[1]]


class Block(keras.layers.Layer):
    """Pre-norm decoder block: x + attn(ln1(x)); h + mlp(ln2(h))."""

    def __init__(self, dim: int, heads: int, hidden: int, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attn = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=dropout)
        self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.mlp = MLP(dim, hidden)

    def call(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, use_causal_mask=True)
        return x + self.mlp(self.ln2(x))


class GPT(keras.Model):
    """A small GPT-style decoder returning logits ``[batch, seq, vocab]``."""

    def __init__(
        self, vocab_size: int, seq_len: int, dim: int, heads: int, depth: int,
        hidden: int | None = None, dropout: float = 0.0, **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tok = keras.layers.Embedding(vocab_size, dim)
        self.pos = PositionEmbedding(seq_len)
        self.blocks = [Block(dim, heads, hidden or 4 * dim, dropout) for _ in range(depth)]
        self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5)
        self.head = keras.layers.Dense(vocab_size, use_bias=False)

    def call(self, ids):
        x = self.pos(self.tok(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTStage(keras.Model):
    """One pipeline stage of a built ``GPT``, cut torchtitan-style: the first stage holds
    the embeddings, the last the final norm and head, each its run of blocks.

    The stage shares the GPT's layers (the same variables) and keeps their names
    (``blocks.2.mlp.up`` stays ``blocks.2.mlp.up``), so a stage's state dict is a
    part of the whole model's: a checkpoint saved by the stages of a pipeline loads
    into the un-pipelined model and back.  Build stages with ``split_gpt``.
    """

    def __init__(self, model: GPT, blocks: range, *, first: bool, last: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tok = model.tok if first else None
        self.pos = model.pos if first else None
        self.blocks = {str(i): model.blocks[i] for i in blocks}
        self.ln_f = model.ln_f if last else None
        self.head = model.head if last else None
        self.built = True  # its layers are the built GPT's

    def call(self, x):
        if self.tok is not None:
            x = self.pos(self.tok(x))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def split_gpt(model: GPT, num_stages: int) -> list[GPTStage]:
    """``model`` cut into ``num_stages`` pipeline stages of consecutive blocks (the
    first stages take one block more when the depth does not divide evenly).

    Example::

        model = GPT(vocab_size=64, seq_len=16, dim=32, heads=4, depth=4)
        model(np.zeros((1, 16), "int32"))             # build it: stages share its variables
        stages = split_gpt(model, 2)                  # blocks 0-1 + embeddings, blocks 2-3 + head
        parallelize_gpt(stages[1], mesh)              # the GPT plan, for the parts it holds
        stage = PipelineStage(stages[1], 1, 2, mesh)
    """
    if not isinstance(model, GPT):
        raise TypeError(f"split_gpt needs a tfdist.models.GPT. Received: model of type {type(model).__name__}")
    if not model.built:
        raise ValueError("split_gpt needs a built GPT (call it once on a batch of token ids): its stages share "
                         "its variables. Received: an unbuilt model")
    depth = len(model.blocks)
    if not isinstance(num_stages, int) or not 1 <= num_stages <= depth:
        raise ValueError(f"num_stages must be an int from 1 to the GPT's depth ({depth}): every stage holds at "
                         f"least one block. Received: num_stages={num_stages!r}")
    sizes = [depth // num_stages + (i < depth % num_stages) for i in range(num_stages)]
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [
        GPTStage(model, range(start, start + size), first=i == 0, last=i == num_stages - 1,
                 name=f"{model.name}_stage{i}")
        for i, (start, size) in enumerate(zip(starts, sizes))
    ]


def gpt_tp_plan(*, sequence_parallel: bool = False, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The GPT plan, written as torchtitan writes Llama's: head-sharded attention,
    Megatron MLP, vocabulary-parallel embedding.

    ``sequence_parallel`` (Megatron-SP): the residual stream and the norms
    are sharded on the sequence (``Shard(1)``); each attention and MLP
    all-gathers the sequence once at its input and its row-parallel
    projection reduce-scatters back onto the sequence -- no all-reduce.
    ``loss_parallel`` (the default) leaves the logits sharded on the vocabulary
    (``Shard(-1)``); Keras ``fit``/``evaluate`` on tfdist compute every
    distributed model's sparse cross-entropy inside ``loss_parallel()``, which
    never gathers the logits, exact.  In a loop of your own, compute the
    loss inside ``with loss_parallel():`` too -- TF DTensor's own kernel is right
    on float32 but returns 0 on float64 class-sharded logits
    (docs/tf_dtensor_repros/float64_sparse_ce_on_class_sharded_logits.py).
    ``loss_parallel=False`` gathers the logits (``Replicate()``), as torch's
    plans without loss parallelism do.
    """
    if not sequence_parallel:
        return {
            "tok": RowwiseParallel(input_layouts=Replicate()),
            "blocks.*.attn.query": ColwiseParallel(),
            "blocks.*.attn.key": ColwiseParallel(),
            "blocks.*.attn.value": ColwiseParallel(),
            "blocks.*.attn.output": RowwiseParallel(),
            "blocks.*.mlp.up": ColwiseParallel(),
            "blocks.*.mlp.down": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate()),
        }
    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "blocks.*.ln1": SequenceParallel(),
        # MultiHeadAttention(query, value): the same normed tensor twice, gathered once
        "blocks.*.attn": PrepareModuleInput(
            input_layouts=(Shard(1), Shard(1)), desired_input_layouts=(Replicate(), Replicate())
        ),
        "blocks.*.attn.query": ColwiseParallel(),
        "blocks.*.attn.key": ColwiseParallel(),
        "blocks.*.attn.value": ColwiseParallel(),
        "blocks.*.attn.output": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(),
        "blocks.*.mlp.up": ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate()),
    }


def _holds(model: GPT | GPTStage, key: str) -> bool:
    """``model`` has the part a plan key starts with (a pipeline stage holds only some)."""
    part = getattr(model, key.split(".")[0], None)
    return part is not None and (not isinstance(part, (dict, list)) or len(part) > 0)


def parallelize_gpt(
    model: GPT | GPTStage, mesh: DeviceMesh, *, sequence_parallel: bool = False, loss_parallel: bool = True
) -> GPT | GPTStage:
    """Tensor parallel over ``mesh["tp"]`` (or a 1-D mesh); batches over the other dim.

    ``model`` may be a pipeline stage from ``split_gpt``: the plan's entries for the
    parts it holds apply (a middle stage has no embeddings and no head).
    """
    tp = mesh["tp"] if mesh.ndim > 1 else mesh
    plan = gpt_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    return parallelize_module(model, tp, {key: style for key, style in plan.items() if _holds(model, key)})
