"""loss_parallel: cross-entropy on class-sharded logits without gathering them.

Inside ``with loss_parallel():`` the sparse categorical cross-entropy of
Keras (``keras.losses.sparse_categorical_crossentropy``,
``SparseCategoricalCrossentropy`` in ``model.fit``, ``ignore_class``
included) and ``tf.nn.sparse_softmax_cross_entropy_with_logits`` are
computed as ``logsumexp(logits) - logits[target]`` with the target logit
picked by a one-hot product.  Every reduction over the class dim is then a
reduction of a sharded dim, which TF DTensor turns into an all-reduce of a
``[batch, seq]`` tensor: the full logits are never gathered.  Values and
gradients equal the unsharded loss.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf

__all__ = ["loss_parallel"]


def sharded_cross_entropy(labels: tf.Tensor, logits: tf.Tensor, axis: int = -1) -> tf.Tensor:
    """Per-example ``-log softmax(logits)[label]``; friendly to a sharded class dim."""
    axis = axis % logits.shape.rank
    peak = tf.stop_gradient(tf.reduce_max(logits, axis=axis, keepdims=True))
    lse = tf.math.log(tf.reduce_sum(tf.exp(logits - peak), axis=axis)) + tf.squeeze(peak, axis)
    one_hot = tf.one_hot(tf.cast(labels, tf.int32), logits.shape[axis], dtype=logits.dtype, axis=axis)
    picked = tf.reduce_sum(one_hot * logits, axis=axis)
    return lse - picked


def _keras_backend_ce(target, output, from_logits=False, axis=-1):
    output = tf.convert_to_tensor(output)
    if not from_logits:
        output = tf.math.log(tf.clip_by_value(output, 1e-7, 1.0 - 1e-7))
    target = tf.convert_to_tensor(target)
    if target.shape.rank == output.shape.rank:  # Keras allows a trailing 1
        target = tf.squeeze(target, axis=-1)
    return sharded_cross_entropy(target, output, axis)


def _tf_ce(labels=None, logits=None, name=None):
    return sharded_cross_entropy(tf.convert_to_tensor(labels), tf.convert_to_tensor(logits))


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Computes sparse cross-entropy on class-sharded logits without a gather.

    Example::

        parallelize_gpt(model, mesh, loss_parallel=True)   # logits stay vocab-sharded
        with loss_parallel():
            model.compile(optimizer="adam",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=16)
    """
    from keras.src.backend.tensorflow import nn as keras_nn

    saved = (keras_nn.sparse_categorical_crossentropy, tf.nn.sparse_softmax_cross_entropy_with_logits)
    keras_nn.sparse_categorical_crossentropy = _keras_backend_ce
    tf.nn.sparse_softmax_cross_entropy_with_logits = _tf_ce
    try:
        yield
    finally:
        keras_nn.sparse_categorical_crossentropy, tf.nn.sparse_softmax_cross_entropy_with_logits = saved
