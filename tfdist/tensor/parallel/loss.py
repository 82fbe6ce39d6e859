"""loss_parallel: cross-entropy on class-sharded logits without gathering them.

Inside ``with loss_parallel():`` the sparse categorical cross-entropy of
Keras (``keras.losses.sparse_categorical_crossentropy``,
``SparseCategoricalCrossentropy`` in ``model.fit``, ``ignore_class``
included) and ``tf.nn.sparse_softmax_cross_entropy_with_logits`` are
computed as ``logsumexp(logits) - logits[target]`` with the target logit
picked by a one-hot product (``multiply_no_nan``).  Dense labels (``CategoricalCrossentropy(
from_logits=True)``, label smoothing included, and
``tf.nn.softmax_cross_entropy_with_logits``) need nothing: TF DTensor's own
kernel already reduces a sharded class dim without gathering it (tested).
Keras' reductions, sample and class weights apply to the per-example values
as usual.  Every reduction over the class dim is then a
reduction of a sharded dim, which TF DTensor turns into an all-reduce of a
``[batch, seq]`` tensor: the full logits are never gathered.  Values and
gradients equal the unsharded loss.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import _patches
from tfdist.tensor import _step_checks
from tfdist.tensor._modules import loaded_backends

__all__ = ["loss_parallel"]


def sharded_cross_entropy(labels: tf.Tensor, logits: tf.Tensor, axis: int = -1) -> tf.Tensor:
    """Per-example ``-log softmax(logits)[label]``; friendly to a sharded class dim."""
    if labels.dtype.is_floating:
        raise TypeError(
            "sparse cross-entropy needs integer class labels (as TF's own). Received: labels of "
            f"dtype {labels.dtype.name}; cast them, e.g. tf.cast(labels, tf.int32)."
        )
    axis = axis % logits.shape.rank
    classes = logits.shape[axis]
    labels = _on_logits_mesh(_checked_labels(labels, classes), logits)
    one_hot = tf.one_hot(tf.cast(labels, tf.int32), classes, dtype=logits.dtype, axis=axis)

    @tf.custom_gradient
    def cross_entropy(logits):
        peak = tf.reduce_max(logits, axis=axis, keepdims=True)
        shifted_exp = tf.exp(logits - peak)
        total = tf.reduce_sum(shifted_exp, axis=axis, keepdims=True)
        # multiply_no_nan, not one_hot * logits: a -inf logit of another class (vocabulary
        # masking) must not turn into 0 * -inf = NaN.
        picked = tf.reduce_sum(tf.math.multiply_no_nan(logits, one_hot), axis=axis)

        def grad(dy):
            # (softmax - one_hot) * dy from the forward's exponentials, in three elementwise ops
            # on the logits' shard; autodiff of the ops above runs more ops, and its broadcasting
            # gradient of multiply_no_nan alone took longer than the whole forward (profiled).
            # The order of operations is TF's kernel's (SparseSoftmaxXentWithLogits: the
            # backprop exp(shifted) / sum - one_hot, then times dy), so on unsharded logits the
            # values are TF's to the last bit and a model trains exactly like one device.
            return (shifted_exp / total - one_hot) * tf.expand_dims(dy, axis)

        # log(sum) - (logit[label] - max), rounded as TF's kernel rounds it
        return tf.squeeze(tf.math.log(total), axis) - (picked - tf.squeeze(peak, axis)), grad

    loss = cross_entropy(logits)
    if not tf.executing_eagerly():
        # An out-of-range label's one-hot is all zeros: a finite, wrong loss.  Raising inside a
        # traced DTensor step is no option (an op error cancels TF's collective executor and
        # poisons every later step), so, as TF's own kernel does on GPU, those rows' loss and
        # gradients become NaN (a product, so the gradient is NaN too).
        # Arithmetic, not a bool mask: TF DTensor may move the factor to the loss's layout, and
        # its collectives carry no bools.  min(l, C-1-l) >= 0 exactly for valid labels, so
        # sqrt(. + 0.5) is finite there (factor 1) and NaN for the others.
        lab = tf.cast(labels, loss.dtype)
        loss = loss * (1.0 + 0.0 * tf.sqrt(tf.minimum(lab, classes - 1.0 - lab) + 0.5))
    return loss


def _on_logits_mesh(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Eager host labels beside DTensor logits, replicated onto the logits' mesh (torch's
    Replicate annotation; eager TF DTensor refuses an op mixing the two)."""
    if not tf.executing_eagerly() or not dtensor.is_dtensor(logits) or dtensor.is_dtensor(labels):
        return labels
    mesh = dtensor.fetch_layout(logits).mesh
    return dtensor.copy_to_mesh(labels, dtensor.Layout.replicated(mesh, labels.shape.rank))


def _checked_labels(labels: tf.Tensor, classes: int) -> tf.Tensor:
    """Out-of-range labels raise as in TF's kernel: eagerly now; in a Keras step on a mesh on the
    host after the step (``_step_checks``: clipped in it); in another traced program they give
    NaN rows."""
    return _step_checks.checked_indices(
        tf.cast(labels, tf.int32), classes, f"Received a label value of {{value}} which is outside the valid range of [0, {classes})."
    )


def _tf_ce(original, labels=None, logits=None, name=None):
    del original, name
    return sharded_cross_entropy(tf.convert_to_tensor(labels), tf.convert_to_tensor(logits))


_active = threading.local()  # whether this thread is inside loss_parallel()


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Computes sparse cross-entropy on class-sharded logits without a gather.

    Only calls made by the thread inside the block are affected; other
    threads keep the ordinary functions, and nothing stays changed after it.

    Example::

        parallelize_gpt(model, mesh, loss_parallel=True)   # logits stay vocab-sharded
        with loss_parallel():
            model.compile(optimizer="adam",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=16)
    """
    if getattr(_active, "on", False):  # nested (fit inside the user's block): already in force
        yield
        return
    with contextlib.ExitStack() as stack:
        _active.on = True
        stack.callback(setattr, _active, "on", False)
        stack.enter_context(_patches.scoped("tensorflow.nn:sparse_softmax_cross_entropy_with_logits", _tf_ce))
        for modules in loaded_backends():
            stack.enter_context(modules.sharded_loss_scope(sharded_cross_entropy))
        yield
