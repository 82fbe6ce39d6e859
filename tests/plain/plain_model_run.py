"""A plain Keras/TF program (no mesh, no keras distribution): prints what it traced and computed.

    python tests/plain/plain_model_run.py [--with-tfdist]

tests/test_architecture.py runs it with and without ``import tfdist.keras`` and requires the same
graphs and numbers: tfdist's rows on TF's and Keras' call paths must be pass-throughs for code it
does not distribute.
"""

import collections
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["PYTHONHASHSEED"] = "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if "--with-tfdist" in sys.argv:
    import tfdist.keras  # noqa: F401  (installs its process-wide rows)

import keras  # noqa: E402
from tensorflow.dtensor.python import api as dtensor_api  # noqa: E402


def op_counts(concrete) -> dict[str, int]:
    counts = collections.Counter(op.type for op in concrete.graph.get_operations())
    for f in concrete.graph._functions.values():  # nested functions (while bodies, called functions)
        counts.update(node.op for node in f.definition.node_def)
    return dict(sorted(counts.items()))


def main() -> None:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(32, 16)(inputs)
    x = keras.layers.MultiHeadAttention(2, 8)(x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Dropout(0.3)(x)
    outputs = keras.layers.Dense(32)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 32, (32, 8)).astype("int32")
    history = model.fit(ids, (ids + 1) % 32, batch_size=8, epochs=2, shuffle=False, verbose=0)

    eager_out = model(ids[:4]).numpy()  # Layer.__call__, eagerly
    with tf.GradientTape() as tape:  # GradientTape.gradient, eagerly
        loss = tf.reduce_mean(model(ids[:4], training=False) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)

    step = tf.function(lambda x: model(x, training=True))
    concrete = step.get_concrete_function(tf.TensorSpec((None, 8), tf.int32))
    plain = tf.function(lambda a, b: tf.matmul(a, b) + 1.0)  # ConcreteFunction._call_flat
    product = plain(tf.ones((3, 3)), tf.ones((3, 3))).numpy()
    print(json.dumps({
        "loss": [float(v) for v in history.history["loss"]],
        "eager_out": float(np.abs(eager_out).sum()),
        "grad_norms": [float(tf.norm(g)) for g in grads],
        "product": product.tolist(),
        "predict": float(np.abs(model.predict(ids, verbose=0)).sum()),
        "call_graph_ops": op_counts(concrete),
        "dtensor_device_made": dtensor_api._dtensor_singleton is not None,
    }))


if __name__ == "__main__":
    main()
