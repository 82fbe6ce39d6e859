"""Run under `tfdist run`: DistributedOptimizer steps FSDP-sharded variables that span every client
from tfdist.autograd contexts; each client checks the weights against plain Keras SGD on one device."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.fsdp import fully_shard  # noqa: E402
from tfdist.keras._data import gather_to_numpy  # noqa: E402
from tfdist.optim import DistributedOptimizer  # noqa: E402

world = int(os.environ["WORLD_SIZE"])
rng = np.random.default_rng(7)
X = rng.standard_normal((16, 8)).astype("float32")
Y = rng.standard_normal((16, 4)).astype("float32")
mse = keras.losses.MeanSquaredError()


def make():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])


mesh = tfdist.init_device_mesh("cpu", (2 * world,), mesh_dim_names=("dp",))  # first: starts the clients
ref, ref_opt = make(), keras.optimizers.SGD(0.1)
for _ in range(3):  # the reference: one plain model on this client's CPU, no mesh
    with tf.GradientTape() as tape:
        loss = mse(Y, ref(X))
    ref_opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)
want = ref.get_weights()

model = make()
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = DistributedOptimizer(keras.optimizers.SGD, model.trainable_variables, learning_rate=0.1)
for _ in range(3):
    with tfdist.autograd.context() as context_id:
        loss = mse(Y, model(X))
        tfdist.autograd.backward(context_id, [loss])
        opt.step(context_id)
got = [gather_to_numpy(v) for v in model.trainable_variables]
for a, b in zip(want, got):
    np.testing.assert_allclose(b, a, atol=1e-6)
tfdist.barrier()
print(f"OK rank {tfdist.get_rank()}: DistributedOptimizer equals one device", flush=True)
