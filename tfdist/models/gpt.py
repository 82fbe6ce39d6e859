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

__all__ = ["GPT", "gpt_tp_plan", "parallelize_gpt"]


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


def parallelize_gpt(
    model: GPT, mesh: DeviceMesh, *, sequence_parallel: bool = False, loss_parallel: bool = True
) -> GPT:
    """Tensor parallel over ``mesh["tp"]`` (or a 1-D mesh); batches over the other dim."""
    tp = mesh["tp"] if mesh.ndim > 1 else mesh
    return parallelize_module(
        model, tp, gpt_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    )
