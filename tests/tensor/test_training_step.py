"""A tf.function training step on DTensors equals the same step on one device."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from conftest import make_mesh
from tfdist.tensor import Replicate, Shard, distribute_tensor


def _mlp_loss(x, y, w1, b1, w2):
    h = tf.nn.relu(x @ w1 + b1)
    out = h @ w2
    return tf.reduce_mean((out - y) ** 2)


def _reference(x, y, w1, b1, w2, lr, steps):
    """Plain TF on one device, no DTensor."""
    params = [tf.Variable(v) for v in (w1, b1, w2)]
    losses = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = _mlp_loss(tf.constant(x), tf.constant(y), *params)
        grads = tape.gradient(loss, params)
        for p, g in zip(params, grads):
            p.assign_sub(lr * g)
        losses.append(float(loss))
    return losses, [p.numpy() for p in params], grads


def test_dp_tp_training_step_matches_single_device():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 12)).astype(np.float32)
    y = rng.standard_normal((16, 6)).astype(np.float32)
    w1 = (rng.standard_normal((12, 32)) * 0.3).astype(np.float32)
    b1 = np.zeros(32, np.float32)
    w2 = (rng.standard_normal((32, 6)) * 0.3).astype(np.float32)
    lr, steps = 0.05, 5

    mesh = make_mesh((2, 4))
    # batch over dp; Megatron MLP over tp: w1 column-wise, w2 row-wise
    dx = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    dy = distribute_tensor(y, mesh, [Shard(0), Replicate()])
    params = [
        distribute_tensor(w1, mesh, [Replicate(), Shard(1)]),
        distribute_tensor(b1, mesh, [Replicate(), Shard(0)]),
        distribute_tensor(w2, mesh, [Replicate(), Shard(0)]),
    ]

    @tf.function
    def train_step(params, x, y):
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss = _mlp_loss(x, y, *params)
        grads = tape.gradient(loss, params)
        new = [p - lr * g for p, g in zip(params, grads)]
        return loss, new, grads

    losses = []
    for _ in range(steps):
        loss, params, grads = train_step(params, dx, dy)
        losses.append(float(loss.numpy()))

    ref_losses, ref_params, ref_grads = _reference(x, y, w1, b1, w2, lr, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(params, ref_params):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    assert [p.placements for p in params] == [
        (Replicate(), Shard(1)), (Replicate(), Shard(0)), (Replicate(), Shard(0)),
    ]
    assert losses[-1] < losses[0]
