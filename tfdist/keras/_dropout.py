"""Keras dropout with a mesh-invariant mask.

Keras' TF backend drops with ``tf.nn.experimental.stateless_dropout``; on
DTensor that op draws per-device streams, so a seeded model with dropout
trains differently on every mesh.  With tfdist.keras imported, Keras'
``dropout`` (the ``Dropout`` layer, MultiHeadAttention's attention dropout,
every layer that calls ``keras.random.dropout``) draws
``tfdist.tensor._random.dropout``: the mask is a hash of (Keras' seed,
global element index).  The same seed gives the same masks, losses and
weights on one device and on any mesh.  Keras' seeding is unchanged
(``SeedGenerator`` state, ``keras.utils.set_random_seed``); only the stream
differs from stock Keras.
"""

from __future__ import annotations

import keras

from tfdist import _patches
from tfdist.keras._backend import tfdist_mesh
from tfdist.tensor import _random

__all__ = ["install"]

_NAME = "keras.src.backend.tensorflow.random:dropout"


def _active_mesh():
    """The TF mesh of the active keras distribution (a model's own, inside its methods)."""
    distribution = keras.distribution.distribution()
    return None if distribution is None else tfdist_mesh(distribution.device_mesh).to_tf()


def install() -> None:
    from keras.src.backend.tensorflow import random as tf_random

    def dropout(inputs, rate, noise_shape=None, seed=None):
        if rate == 1.0 or rate == 0.0:
            return original(inputs, rate, noise_shape, seed)
        seed = tf_random.draw_seed(seed)
        noise_shape = tf_random._get_concrete_noise_shape(inputs, noise_shape)
        return _random.dropout(inputs, rate, noise_shape, seed, mesh=_active_mesh())

    original = _patches.original(_NAME)
    _patches.install(_NAME, dropout)
