"""Out-of-range ids and labels in a step on a mesh raise as on one device, and the process goes on.

One device (TF's CPU kernels) raises ``InvalidArgumentError`` for a gather of an id outside its
table and for a sparse cross-entropy label outside its classes.  On a mesh, without tfdist's
checks, the first stopped the expanded program and left every later collective failing; the
second trained on NaN.  Reference: the one-device error, and numpy's forward of the same
weights after the error (the process still computes right).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tensorflow.experimental import dtensor

import tfdist.keras  # noqa: F401  (keras.distribution on TensorFlow)
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.tensor import _step_checks

RNG = np.random.default_rng(71)
V, D, C, B, S = 64, 8, 16, 16, 4


def _model(mesh_shape, emb_layout):
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices=keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*emb/embeddings"] = emb_layout
    layout_map[".*head/kernel"] = (None, "model")  # class-sharded logits: tfdist's sharded cross-entropy
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((S,), dtype="int32"), keras.layers.Embedding(V, D, name="emb"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(C, name="head")])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _numpy_forward(model, ids):
    table, kernel, bias = (np.asarray(w) for w in model.get_weights())
    return table[ids].mean(axis=1) @ kernel + bias


@pytest.mark.parametrize("mesh_shape,emb_layout", [((2, 4), ("model", None)), ((4, 2), ("model", "batch")),
                                                   ((2, 4), (None, "model"))])
@pytest.mark.parametrize("bad_id,shown", [(V, V), (-70, -6)])  # Keras' take wraps negatives once: -70 -> -6
def test_an_id_outside_the_table_raises_in_fit_and_predict_and_the_process_goes_on(mesh_shape, emb_layout, bad_id,
                                                                                   shown):
    model = _model(mesh_shape, emb_layout)
    ids, labels = RNG.integers(0, V, (B, S)).astype("int32"), RNG.integers(0, C, (B,))
    bad = ids.copy()
    bad[5, 2] = bad_id
    message = rf"(indices =|id) {shown} is not in \[0, {V}\)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        model.predict(bad, batch_size=B, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        model.fit(bad, labels, batch_size=B, verbose=0)
    # the process still computes: predict equals numpy on the weights fit left, and fit trains
    np.testing.assert_allclose(model.predict(ids, batch_size=B, verbose=0), _numpy_forward(model, ids), atol=1e-5)
    loss = model.fit(ids, labels, batch_size=B, verbose=0).history["loss"][0]
    assert np.isfinite(loss)
    held = model.layers[0].embeddings.value  # held with the map's layout, not replicated
    assert tuple(dtensor.fetch_layout(held).sharding_specs) == tuple(d or dtensor.UNSHARDED for d in emb_layout)


@pytest.mark.parametrize("bad_label", [C, -2])
def test_a_label_outside_the_classes_raises_in_fit_with_tfs_message(bad_label):
    model = _model((2, 4), (None, "model"))
    ids, labels = RNG.integers(0, V, (B, S)).astype("int32"), RNG.integers(0, C, (B,))
    bad = labels.copy()
    bad[7] = bad_label
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"Received a label value of {bad_label} which is outside the valid range of \[0, {C}\)"):
        model.fit(ids, bad, batch_size=B, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="label value"):
        model.evaluate(ids, bad, batch_size=B, verbose=0)
    # one device's loss for good labels, from the weights the failed step left
    logits = _numpy_forward(model, ids)
    shifted = logits - logits.max(axis=1, keepdims=True)
    want = np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(B), labels])
    np.testing.assert_allclose(model.evaluate(ids, labels, batch_size=B, verbose=0), want, rtol=1e-5)


def test_a_checked_step_returns_the_extremes_and_leaves_nested_functions_alone():
    """The mechanism alone: ``checked_step`` records a traced gather's ids (not a nested
    function's, whose tensors the step cannot return), clips them, and ``raise_failed`` raises
    TF's message for the first check out of range."""
    from tfdist.tensor._legalize import tagging

    table = tf.reshape(tf.range(40.0), [10, 4])

    def step(ids):
        inner = tf.function(lambda i: tf.gather(table, i))  # traced into its own graph
        return tf.gather(table, ids), inner(tf.constant([1]))

    checked = _step_checks.checked_step(step)
    program = tf.function(checked)
    with tagging():
        (rows, _), extremes = program(tf.constant([[3, 12], [0, -4]]))
    assert len(checked.checks.checks) == 1  # the nested gather is not checked
    np.testing.assert_array_equal(extremes.numpy(), [4, 12])  # -min, max
    np.testing.assert_array_equal(rows.numpy(), table.numpy()[[[3, 9], [0, 0]]])  # clipped
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices = -4 is not in \[0, 10\)"):
        checked.checks.raise_failed(extremes.numpy())
    checked.checks.raise_failed(np.array([0, 9]))  # in range: nothing raised
    with pytest.raises(tf.errors.InvalidArgumentError, match="id 10 is"):  # eagerly: raised at once
        _step_checks.checked_indices(tf.constant([10]), 10, "id {value} is out")
