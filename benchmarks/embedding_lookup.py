"""Row-parallel (vocabulary-sharded) Embedding: tfdist's local lookup vs a one-hot matmul.

torch looks each id up in the rows its rank owns and reduces the partial
rows (an all-reduce, or a reduce-scatter onto the sequence); tfdist does the
same (``RowwiseParallel`` on a Keras ``Embedding``: a local gather that is a
Partial).  The one-hot alternative -- what tfdist did before, and the way to
write it in plain TF DTensor without gathering the table -- multiplies a
``[batch, seq, vocab/T]`` one-hot block by the local table rows.

Both run the forward and backward of ``sum(sin(embedding(ids)))`` in one
``tf.function`` on a 1-D mesh of 8, interleaved in rounds; both must give
the same loss and table gradient.  Reported: train-step time, and the
largest tensor device 0 materialises in the forward alone and in the train
step, read from the per-device programs TF executed (run-metadata partition
graphs).  The lookup's gradient is a segment sum of the output gradient into
each device's own rows (TF's gradient of a batched gather would scatter
into, and all-reduce, the whole table): no one-hot block in either pass.

Run: python benchmarks/embedding_lookup.py [--vocab 32768]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

tfdist.virtual_cpus(8)

import keras  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

from _common import largest_tensor_bytes, print_table, time_call, write_results  # noqa: E402
from tfdist.keras._data import gather_to_numpy  # noqa: E402
from tfdist.tensor import Replicate  # noqa: E402
from tfdist.tensor.parallel import RowwiseParallel, parallelize_module  # noqa: E402

U = dtensor.UNSHARDED


def tfdist_step(table_np, mesh, ids):
    keras.utils.set_random_seed(0)
    emb = keras.layers.Embedding(*table_np.shape)
    emb.build((None,))
    emb.embeddings.assign(table_np)
    parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(emb(ids)))
        return loss, tape.gradient(loss, emb.embeddings.value)

    forward = tf.function(lambda ids: emb(ids))
    return (lambda: step(ids)), (lambda: forward(ids))


def one_hot_step(table_np, mesh, ids):
    tf_mesh = mesh.to_tf()
    rep = dtensor.Layout.replicated(tf_mesh, 2)
    table = dtensor.DVariable(dtensor.relayout(dtensor.copy_to_mesh(tf.constant(table_np), rep),
                                               dtensor.Layout(["x", U], tf_mesh)))
    vocab = table_np.shape[0]

    def lookup(ids):
        one_hot = dtensor.relayout(tf.one_hot(ids, vocab), dtensor.Layout([U, U, "x"], tf_mesh))
        return tf.einsum("bsv,vd->bsd", one_hot, table)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(lookup(ids)))
        return loss, tape.gradient(loss, table)

    forward = tf.function(lookup)
    return (lambda: step(ids)), (lambda: forward(ids))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    table_np = (rng.standard_normal((args.vocab, args.dim)) * 0.02).astype("float32")
    mesh = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))
    ids_np = rng.integers(0, args.vocab, (args.batch, args.seq)).astype("int32")
    ids = dtensor.copy_to_mesh(tf.constant(ids_np), dtensor.Layout.replicated(mesh.to_tf(), 2))
    programs = {"tfdist local lookup (RowwiseParallel)": tfdist_step(table_np, mesh, ids),
                "one-hot matmul (plain TF DTensor)": one_hot_step(table_np, mesh, ids)}
    largest, largest_forward, first = {}, {}, {}
    for name, (step, forward) in programs.items():
        out = []
        largest[name] = largest_tensor_bytes(lambda step=step: out.append(step()))
        largest_forward[name] = largest_tensor_bytes(forward)
        first[name] = [gather_to_numpy(t) for t in out[0]]
    (loss_a, grad_a), (loss_b, grad_b) = first.values()
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-4)
    np.testing.assert_allclose(grad_a, grad_b, atol=1e-4)
    programs = {name: step for name, (step, _) in programs.items()}
    sync = lambda out: [gather_to_numpy(t) for t in out]  # noqa: E731
    samples: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(args.rounds):
        for name, fn in programs.items():
            samples[name].append(time_call(fn, sync, warmup=1, repeat=args.steps))
    base = float(np.median(samples["one-hot matmul (plain TF DTensor)"]))
    rows = [{"program": name, "step_ms": round(float(np.median(v)), 2),
             "vs_one_hot": round(float(np.median(v)) / base, 3),
             "largest_tensor_MB_forward": round(largest_forward[name] / 2**20, 2),
             "largest_tensor_MB_train_step": round(largest[name] / 2**20, 2)} for name, v in samples.items()]
    meta = {"shape": vars(args), "mesh": "1-D, 8 virtual CPUs", "same_loss_and_gradient": True}
    path = write_results("embedding_lookup", rows, meta)
    print_table(rows, ["program", "step_ms", "vs_one_hot", "largest_tensor_MB_forward", "largest_tensor_MB_train_step"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
