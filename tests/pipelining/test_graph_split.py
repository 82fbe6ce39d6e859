"""pipeline() on graphs: subclassed models traced through their call, functional models with skip
connections across cuts, torch-style split names, and what cannot be cut.

Reference: the same model run whole on one device (float64): its output and
its gradients, and its weights after Adam steps on the whole batch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_helpers import float64, no_global_distribution  # noqa: F401
from tfdist.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipe_split, pipeline
from tfdist.pipelining.stage import build_stage

RNG = np.random.default_rng(1)
X, Y = RNG.standard_normal((16, 8)), RNG.standard_normal((16, 8))


def mse(y, t):
    return tf.reduce_mean((y - t) ** 2)


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up, self.down = keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8)

    def call(self, x):
        return self.down(self.up(x))


class ResidualNet(keras.Model):
    """Residual blocks, a marker after block 1, and a skip from the input to the output."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Dense(8)
        self.blocks = [Block() for _ in range(4)]
        self.proj, self.head = keras.layers.Dense(8), keras.layers.Dense(8)

    def call(self, x):
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = h + block(h)
            if i == 1:
                h = pipe_split()(h)
        return self.head(h) + self.proj(x)


def residual_net(seed=0):
    keras.utils.set_random_seed(seed)
    model = ResidualNet()
    model(X[:1])
    return model


def whole_batch_grads(model):
    with tf.GradientTape() as tape:
        loss = mse(model(X), Y)
    return loss, tape.gradient(loss, model.trainable_variables)


def grads_by_variable(stages):
    return {id(v): g for s in stages for v, g in zip(s.submod.trainable_variables, s.grads)}


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_a_subclassed_model_is_traced_cut_and_gives_the_whole_models_gradients(float64, schedule):
    model = residual_net()
    want_out = model(X).numpy()
    _, want = whole_batch_grads(model)
    pipe = pipeline(model, (X[:4],), split_spec={"blocks.3": SplitPoint.BEGINNING})  # torch's FQN form
    assert pipe.num_stages == 3
    # the input x is used by the last stage (proj): it crosses both cuts beside the hidden state
    assert [len(s) for s in pipe.info().stage_inputs] == [1, 2, 2]
    assert [len(s) for s in pipe.info().stage_outputs] == [2, 2, 1]
    assert pipe.get_stage_module(1).trainable_variables[0] is model.blocks[2].up.kernel  # shared, path kept
    stages = [pipe.build_stage(i, f"CPU:{2 * i}") for i in range(3)]
    out = schedule(stages, 4, loss_fn=mse).step(X, target=Y)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12)
    got = grads_by_variable(stages)
    assert len(got) == len(model.trainable_variables)
    for v, g in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got[id(v)].numpy(), g.numpy(), rtol=1e-10, atol=1e-13)


def test_a_traced_pipeline_trains_like_the_whole_model(float64):
    ref, model = residual_net(), residual_net()
    pipe = pipeline(model, (X[:4],))  # the marker alone: two stages
    assert pipe.num_stages == 2
    stages = [pipe.build_stage(i, f"CPU:{4 * i}") for i in range(2)]
    schedule = Schedule1F1B(stages, 4, loss_fn=mse)
    ref_opt, opt = keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2)
    for _ in range(10):
        _, grads = whole_batch_grads(ref)
        ref_opt.apply(grads, ref.trainable_variables)
        for s in stages:
            s.zero_grads()
        schedule.step(X, target=Y)
        by_var = grads_by_variable(stages)
        opt.apply([by_var[id(v)] for v in model.trainable_variables], model.trainable_variables)
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)


def test_a_functional_skip_connection_crosses_the_cut(float64):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    a = keras.layers.Dense(8, activation="tanh", name="a")(inputs)
    b = keras.layers.Dense(8, activation="tanh", name="b")(a)
    c = keras.layers.Dense(8, name="c")(b)
    model = keras.Model(inputs, keras.layers.Add(name="add")([a, c]))
    _, want = whole_batch_grads(model)
    pipe = pipeline(model, (X[:8],), split_spec={"b": SplitPoint.END})
    assert [[l.name for l in pipe.get_stage_module(i).layers] for i in range(2)] == [["a", "b"], ["c", "add"]]
    assert [len(s) for s in pipe.info().stage_inputs] == [1, 2]  # b's output and the skip from a
    # torch's function form at its path, tfdist.pipelining.stage.build_stage, as torch's tracer-built stages use it
    stages = [build_stage(pipe.get_stage_module(i), i, pipe.info(), f"CPU:{i}") for i in range(2)]
    ScheduleGPipe(stages, 2, loss_fn=mse).step(X, target=Y)
    got = grads_by_variable(stages)
    for v, g in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got[id(v)].numpy(), g.numpy(), rtol=1e-10, atol=1e-13)


class UsesTensorFlowOps(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)

    def call(self, x):
        return tf.nn.relu(self.dense(x))


class SharedLayer(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shared, self.middle = keras.layers.Dense(8, name="shared"), keras.layers.Dense(8, name="middle")

    def call(self, x):
        return self.shared(self.middle(self.shared(x)))


def test_what_cannot_be_cut_says_why(float64):
    model = UsesTensorFlowOps()
    with pytest.raises(TypeError, match="(?s)UsesTensorFlowOps.call could not be traced.*use keras.ops"):
        pipeline(model, (X[:4],), split_spec={"dense": SplitPoint.END})
    with pytest.raises(ValueError, match="layer 'shared' is called in stages 0 and 1"):
        pipeline(SharedLayer(), (X[:4],), split_spec={"middle": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match="'blocks.1.up' names no layer of the model"):
        pipeline(residual_net(), (X[:4],), split_spec={"blocks.1.up": SplitPoint.END})  # not called by call
    with pytest.raises(TypeError, match="module must be a Keras model"):
        pipeline(lambda x: x, (X[:4],))


class MaskedNet(keras.Model):
    """Takes a keyword input used on both sides of the cut (as an attention mask is in every block)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed, self.block, self.head = keras.layers.Dense(8), Block(), keras.layers.Dense(8)

    def call(self, x, attention_mask=None, scale=1.0):
        h = self.embed(x) * attention_mask
        h = pipe_split()(h + self.block(h))
        return self.head(h) * attention_mask * scale


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_keyword_inputs_reach_the_stages_that_use_them(float64, schedule):
    keras.utils.set_random_seed(3)
    model = MaskedNet()
    mask = (RNG.random((16, 8)) > 0.3).astype("float64")
    model(X[:1], attention_mask=mask[:1], scale=0.5)
    with tf.GradientTape() as tape:  # the reference: the whole model on the whole batch, one device
        want_out = model(X, attention_mask=mask, scale=0.5)
        loss = mse(want_out, Y)
    want = tape.gradient(loss, model.trainable_variables)
    pipe = pipeline(model, (X[:4],), mb_kwargs={"attention_mask": mask[:4], "scale": 0.5})
    assert pipe.num_stages == 2
    assert [len(s) for s in pipe.info().stage_inputs] == [1, 2]  # the mask crosses the cut beside h
    stages = [pipe.build_stage(i, f"CPU:{3 * i}") for i in range(2)]
    out = schedule(stages, 4, loss_fn=mse).step(X, target=Y, attention_mask=mask)
    np.testing.assert_allclose(out.numpy(), want_out.numpy(), rtol=1e-12)
    got = grads_by_variable(stages)
    for v, g in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got[id(v)].numpy(), g.numpy(), rtol=1e-10, atol=1e-13)
    with pytest.raises(TypeError, match=r"stage_0: takes the keyword inputs \['attention_mask'\].*Received: \[\]"):
        pipe.get_stage_module(0)(tf.constant(X[:4]))
    with pytest.raises(ValueError, match=r"mb_kwargs=\['attention_mask'\] given for a Sequential model"):
        pipeline(keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), pipe_split(), keras.layers.Dense(8)]),
                 (X[:4],), mb_kwargs={"attention_mask": mask[:4]})
