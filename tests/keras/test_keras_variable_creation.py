"""Keras variables on a mesh: each new variable of a shape, dtype and layout TF DTensor has seen
reuses its lowered handle op (tfdist/keras/_backend.new_dvariable), and keeps the name
``tf.Variable`` would give it.  References: TF DTensor's own cache counters (a miss is one SPMD
expansion) and the name a plain ``tf.Variable`` gets in the same scope."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from tensorflow.dtensor.python import api as dtensor_api
from tensorflow.experimental import dtensor

import tfdist.keras  # noqa: F401  (the Keras plug-in)
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.keras._backend import new_dvariable


def _lowerings() -> int:
    """How many eager ops and functions TF DTensor has SPMD-expanded in this process."""
    return dtensor_api._dtensor_device()._get_stats()["function_manager.miss"]


def _tp_distribution():
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/kernel"] = (None, "model")
    layout_map[".*/bias"] = ("model",)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_a_layer_like_one_built_before_costs_no_new_lowering():
    keras.distribution.set_distribution(_tp_distribution())
    first = keras.layers.Dense(64, name="first")
    first.build((None, 64))
    before = _lowerings()
    second = keras.layers.Dense(64, name="second")  # same shapes and layouts, its own names
    second.build((None, 64))
    # before the fix each new name lowered its VarHandleOp again: 2 more (kernel, bias)
    assert _lowerings() == before, (before, _lowerings())
    assert [v.path for v in second.weights] == ["second/kernel", "second/bias"]
    assert second.kernel.value.layout.sharding_specs == ["unsharded", "model"]
    np.testing.assert_array_equal(second.bias.numpy(), np.zeros(64, np.float32))


def test_optimizer_slots_of_a_second_model_cost_no_new_lowering_and_train():
    keras.distribution.set_distribution(_tp_distribution())
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)

    def fitted():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, name="up"),
                                  keras.layers.Dense(64, name="down")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.fit(x, x, batch_size=16, epochs=1, verbose=0)
        return model

    fitted()
    before = _lowerings()
    model = fitted()
    created = _lowerings() - before
    # the second fit lowers its own train step program and nothing else: none of its 4 weights' and
    # 8 Adam slots' handle ops (15 lowerings before the fix)
    assert created == 1, created
    assert all(np.isfinite(w).all() for w in model.get_weights())
    slots = sorted(v.path.split("/")[-1].split("_", 2)[-1] for v in model.optimizer.variables
                   if v.path.endswith(("momentum", "velocity")))
    assert slots == sorted(f"{layer}_{kind}_{slot}" for layer in ("up", "down") for kind in ("kernel", "bias")
                           for slot in ("momentum", "velocity")), slots


def test_names_are_what_tf_variable_gives_in_the_same_scope():
    layout = dtensor.Layout.replicated(dtensor.create_mesh([("x", 8)], device_type="CPU"), 1)
    with tf.name_scope("block"):
        made = new_dvariable(tf.zeros(4), layout, name="scale")
        unnamed = new_dvariable(tf.zeros(4), layout)
        plain, plain_unnamed = tf.Variable(tf.zeros(4), name="scale"), tf.Variable(tf.zeros(4))
    assert made.name == plain.name == "block/scale:0"
    assert unnamed.name == plain_unnamed.name == "block/Variable:0"
    assert made._unique_id != unnamed._unique_id
    made.assign_add(dtensor.call_with_layout(tf.ones, layout, shape=(4,)))  # the variable behind the renamed handle is its own
    np.testing.assert_array_equal(dtensor.unpack(made.read_value())[3].numpy(), np.ones(4, np.float32))
    np.testing.assert_array_equal(dtensor.unpack(unnamed.read_value())[3].numpy(), np.zeros(4, np.float32))
