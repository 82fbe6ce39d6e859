"""Run under `tfdist run` with 4 clients of 2 devices: DistributedDataParallel starts every replica
from client 0's weights (the clients initialise differently) and post-local SGD trains like the
per-replica numpy reference of tests/test_post_local_sgd.py."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.keras._data import gather_to_numpy  # noqa: E402

mesh = tfdist.init_device_mesh("cpu", (2 * int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("dp",))
import test_post_local_sgd as ref  # noqa: E402  (its reference: 8 replicas, seed-0 weights)
from tfdist.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook  # noqa: E402
from tfdist.algorithms.model_averaging import averagers  # noqa: E402
from tfdist.nn.parallel import DistributedDataParallel  # noqa: E402
from tfdist.optim import PostLocalSGDOptimizer  # noqa: E402

keras.utils.set_random_seed(tfdist.get_rank())  # each client its own initial weights
module = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])
model = DistributedDataParallel(module, device_mesh=mesh)
model.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=2, post_local_gradient_allreduce=False),
                         post_localSGD_hook)
opt = PostLocalSGDOptimizer(keras.optimizers.SGD(ref.LR), averagers.PeriodicModelAverager(period=3, warmup_steps=2))
step = ref.train_step(model, opt)
for _ in range(ref.STEPS):
    step(tf.constant(ref.X), tf.constant(ref.Y))
want = ref.local_sgd_reference(start=2, period=3, warmup=2, allreduce_after=False)
for k, variable in enumerate(model.trainable_variables):
    np.testing.assert_allclose(gather_to_numpy(variable), np.stack([rep[k] for rep in want]), rtol=1e-5, atol=1e-6)
tfdist.barrier()
print(f"OK rank {tfdist.get_rank()}: local SGD replicas equal the reference", flush=True)
