"""Train-step time of the tensor-parallel GPT: tfdist vs raw TF DTensor vs one device vs tf_keras.

All four run the same model (GPT, SGD) on the same batch:

- tfdist: Keras 3 ``GPT`` + ``parallelize_gpt`` on a 2x4 mesh (dp x tp),
  timed as Keras' own train function (one ``model.fit`` step), with the
  TP-only plan and with torch's sequence-parallel plan
  (``sequence_parallel=True``); the bytes each device sends per step are
  read from the programs TF executed (``executed_collective_bytes``);
- raw TF DTensor: the same math written by hand on ``dtensor.DVariable``s
  with the same layouts, in one ``tf.function``;
- one device: the Keras 3 model without any distribution;
- tf_keras (Keras 2) DTensor layout maps on the same model.  Its run is
  attempted and its failure, if any, recorded (see
  docs/tf_dtensor_repros/tf_keras_dtensor_fit.py: embeddings cannot train).

Run: python benchmarks/tp_transformer.py [--steps 20]
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

import _handwritten  # noqa: E402
from _common import executed_collective_bytes, print_table, time_call, write_results  # noqa: E402
from tfdist.keras import _data  # noqa: E402
from tfdist.models import GPT, parallelize_gpt  # noqa: E402

VOCAB, SEQ, DIM, HEADS, DEPTH, BATCH, LR = 256, 64, 128, 8, 2, 16, 0.05
U = dtensor.UNSHARDED


def make_gpt():
    keras.utils.set_random_seed(0)
    model = GPT(VOCAB, SEQ, DIM, HEADS, DEPTH)
    model(np.zeros((1, SEQ), "int32"))
    return model


def keras_step_fn(model, x, y, mesh=None):
    model.compile(optimizer=keras.optimizers.SGD(LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.make_train_function()
    step = model.train_function
    if mesh is not None:
        batch = _data.shard_batch((tf.constant(x), tf.constant(y)), mesh, 0)
    else:
        batch = (tf.constant(x), tf.constant(y))
    return lambda: step(iter([batch]))


def raw_dtensor_step_fn(reference: GPT, tf_mesh, x, y):
    """The same GPT forward/backward/SGD written directly with tf.experimental.dtensor.

    With ``tf_mesh=None`` the same program runs on plain variables on one device.
    """
    w, forward = _handwritten.gpt(reference, tf_mesh, VOCAB, SEQ, DIM, HEADS)
    names = sorted(w)

    @tf.function
    def step(ids, labels):
        with tf.GradientTape() as tape:
            logits = forward(ids)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        grads = tape.gradient(loss, [w[n] for n in names])
        for n, g in zip(names, grads):
            w[n].assign_sub(LR * tf.convert_to_tensor(g))
        return loss

    ids, labels = tf.constant(x, tf.int32), tf.constant(y, tf.int32)
    if tf_mesh is not None:
        ids, labels = _data.shard_batch((ids, labels), tfdist.DeviceMesh.from_tf(tf_mesh), 0)
    return lambda: step(ids, labels)


def tf_keras_step_fn(x, y):
    """tf_keras (Keras 2) with DTensor layout maps on the same architecture; returns (fn, error)."""
    try:
        import tf_keras

        tf_keras.backend.experimental.enable_tf_random_generator()
        tf_keras.utils.set_random_seed(0)

        tf_mesh = dtensor.create_mesh([("dp", 2), ("tp", 4)], device_type="CPU")
        model = _handwritten.tf_keras_gpt(tf_mesh, "tp", VOCAB, SEQ, DIM, HEADS, DEPTH)
        model.compile(optimizer=tf_keras.dtensor.experimental.optimizers.SGD(LR, mesh=tf_mesh),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        return (lambda: model.train_on_batch(x[:BATCH], y[:BATCH])), None
    except Exception as err:  # noqa: BLE001 - the failure is the result
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
    y = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
    sync = lambda out: tf.nest.map_structure(  # noqa: E731
        lambda t: _data.gather_to_numpy(t) if isinstance(t, tf.Tensor) else t, out)

    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    reference = make_gpt()
    raw = raw_dtensor_step_fn(reference, mesh.to_tf(), x, y)
    raw_one = raw_dtensor_step_fn(reference, None, x, y)
    one = keras_step_fn(make_gpt(), x, y)
    ours = keras_step_fn(parallelize_gpt(make_gpt(), mesh), x, y, mesh)
    ours_sp = keras_step_fn(parallelize_gpt(make_gpt(), mesh, sequence_parallel=True), x, y, mesh)
    # The first step of every program, from the same weights on the same batch: same loss.
    first, sent = {}, {}
    for name, fn in (("tp", ours), ("tp+sp", ours_sp), ("raw", raw), ("one", one), ("raw_one", raw_one)):
        out = []
        sent[name] = executed_collective_bytes(lambda fn=fn: out.append(fn()))
        loss = out[0]["loss"] if isinstance(out[0], dict) else out[0]
        first[name] = float(_data.gather_to_numpy(loss))
    if max(first.values()) - min(first.values()) > 1e-4 * abs(first["one"]):
        raise SystemExit(f"the programs disagree on the first step's loss: {first}")
    rows = []
    programs = (("tfdist (Keras 3 + parallelize_gpt)", ours), ("tfdist, sequence-parallel plan", ours_sp),
                ("raw TF DTensor (hand-written)", raw),
                ("one device (Keras 3)", one), ("one device (hand-written TF)", raw_one))
    # Interleaved rounds, median of the round medians: a 2-core machine is noisy.
    samples: dict[str, list[float]] = {name: [] for name, _ in programs}
    for _ in range(args.rounds):
        for name, fn in programs:
            samples[name].append(time_call(fn, sync, warmup=2, repeat=args.steps))
    timings = {name: float(np.median(v)) for name, v in samples.items()}
    keras.distribution.set_distribution(None)
    tf_keras_fn, tf_keras_error = tf_keras_step_fn(x, y)
    if tf_keras_fn is not None:
        timings["tf_keras DTensor layout map"] = time_call(tf_keras_fn, lambda out: out, warmup=2, repeat=args.steps)
    base = timings["raw TF DTensor (hand-written)"]
    sent_by_program = {"tfdist (Keras 3 + parallelize_gpt)": sent["tp"], "tfdist, sequence-parallel plan": sent["tp+sp"],
                       "raw TF DTensor (hand-written)": sent["raw"]}
    for name, ms in timings.items():
        row = {"program": name, "step_ms": round(ms, 2), "vs_raw_dtensor": round(ms / base, 3)}
        if name in sent_by_program:
            by_kernel = sent_by_program[name]
            row["MB_sent_per_device"] = round(sum(by_kernel.values()) / 2**20, 3)
            row["by_kernel_MB"] = {k.replace("Collective", "").replace("V2", ""): round(v / 2**20, 3)
                                   for k, v in sorted(by_kernel.items())}
        rows.append(row)
    keras_overhead = timings["one device (Keras 3)"] / timings["one device (hand-written TF)"]
    tfdist_overhead = timings["tfdist (Keras 3 + parallelize_gpt)"] / base
    meta_ratios = {"keras_vs_handwritten_one_device": round(keras_overhead, 3),
                   "tfdist_keras_vs_handwritten_dtensor": round(tfdist_overhead, 3)}
    if tf_keras_error:
        rows.append({"program": "tf_keras DTensor layout map", "step_ms": "failed", "vs_raw_dtensor": tf_keras_error})
    meta = {"model": dict(vocab=VOCAB, seq=SEQ, dim=DIM, heads=HEADS, depth=DEPTH, batch=BATCH),
            "first_step_loss": first,
            "mesh": "2x4 (dp x tp), 8 virtual CPUs", "optimizer": "SGD", "ratios": meta_ratios}
    path = write_results("tp_transformer", rows, meta)
    print_table(rows, ["program", "step_ms", "vs_raw_dtensor", "MB_sent_per_device", "by_kernel_MB"])
    print(f"\nKeras 3 step vs hand-written TF, one device: {meta_ratios['keras_vs_handwritten_one_device']}x; "
          f"tfdist Keras step vs hand-written TF DTensor: {meta_ratios['tfdist_keras_vs_handwritten_dtensor']}x")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
