"""Keras' random layers with mesh-invariant draws.

Keras' TF backend draws with TF's stateless random ops; on DTensor those
draw per-device streams, so a seeded model with dropout or noise trains
differently on every mesh.  With tfdist.keras imported, for a model on a mesh
(under a keras distribution: a model's own, which ``parallelize_module`` /
``fully_shard`` give it, or a global one):

* Keras' ``dropout`` (the ``Dropout`` layer, MultiHeadAttention's attention
  dropout, ``keras.random.dropout``) keeps an element when a hash of
  (Keras' seed, global element index) passes the rate
  (``tfdist.tensor._random.dropout``);
* ``GaussianNoise``, ``GaussianDropout`` and ``AlphaDropout`` draw their
  normal or uniform noise the same way while their ``call`` runs (a
  with-block patch of Keras' backend ``normal``/``uniform``; initializers and
  other callers keep Keras' own streams).

Values are computed on each device for its own shard.  The same seed gives
the same masks, noise, losses and weights on every mesh -- a mesh of one
device included, which is how to get a one-device reference with the same
draws (``parallelize_module(model, tfdist.DeviceMesh("cpu", [0]), {})``).
A plain model (no distribution) keeps Keras' own stream and graph: tfdist
changes nothing for code it does not distribute.  Keras' seeding is
unchanged (``SeedGenerator`` state, ``keras.utils.set_random_seed``).
"""

from __future__ import annotations

import keras

from tfdist import _patches
from tfdist.keras._backend import tfdist_mesh
from tfdist.keras._keras_internals import tf_random
from tfdist.tensor import _random

__all__ = ["install"]

_DROPOUT = "keras.src.backend.tensorflow.random:dropout"
_NORMAL = "keras.src.backend.tensorflow.random:normal"
_UNIFORM = "keras.src.backend.tensorflow.random:uniform"
_NOISE_LAYERS = {
    "keras.src.layers.regularization.gaussian_noise:GaussianNoise.call": _NORMAL,
    "keras.src.layers.regularization.gaussian_dropout:GaussianDropout.call": _NORMAL,
    "keras.src.layers.regularization.alpha_dropout:AlphaDropout.call": _UNIFORM,
}


def _active_mesh():
    """The TF mesh of the active keras distribution (a model's own, inside its methods)."""
    distribution = keras.distribution.distribution()
    return None if distribution is None else tfdist_mesh(distribution.device_mesh).to_tf()


def _seed(seed):
    """Keras' seed for one draw (recorded or replayed inside an HSDP replica group's program)."""
    return _random.group_seed(lambda: tf_random.draw_seed(seed))


def _normal(original, shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    dtype = keras.backend.standardize_dtype(dtype or keras.config.floatx())
    return _random.draw_like("normal", shape, _seed(seed), dtype, _active_mesh(), mean, stddev)


def _uniform(original, shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    dtype = keras.backend.standardize_dtype(dtype or keras.config.floatx())
    return _random.draw_like("uniform", shape, _seed(seed), dtype, _active_mesh(), minval, maxval)


def _install_noise_layers() -> None:
    for name, draw in _NOISE_LAYERS.items():
        original = _patches.original(name)
        replacement = _normal if draw == _NORMAL else _uniform

        def call(self, inputs, training=False, _original=original, _draw=draw, _replacement=replacement):
            if keras.distribution.distribution() is None:  # a plain model: Keras' own stream
                return _original(self, inputs, training=training)
            with _patches.scoped(_draw, _replacement):
                return _original(self, inputs, training=training)

        _patches.install(name, call)


def install() -> None:
    def dropout(inputs, rate, noise_shape=None, seed=None):
        if rate == 1.0 or rate == 0.0 or keras.distribution.distribution() is None:
            return original(inputs, rate, noise_shape, seed)  # a plain model: Keras' own stream
        seed = _seed(seed)
        noise_shape = tf_random._get_concrete_noise_shape(inputs, noise_shape)
        return _random.dropout(inputs, rate, noise_shape, seed, mesh=_active_mesh())

    original = _patches.original(_DROPOUT)
    _patches.install(_DROPOUT, dropout)
    _install_noise_layers()
