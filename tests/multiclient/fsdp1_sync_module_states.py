"""Run under `tfdist run`: clients initialise differently (seed = rank); FSDP1's sync_module_states
gives the sharded model client 0's weights, without it the shards come from each client's own."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tfdist  # noqa: E402

import keras  # noqa: E402
from tfdist.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from tfdist.tensor import DTensor  # noqa: E402

mesh = tfdist.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))  # starts the clients first
rank = tfdist.get_rank()
sync = sys.argv[1] == "sync"


def mlp(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="up"), keras.layers.Dense(8, name="down")])
    return model


client_0 = [w.numpy() for w in mlp(0).weights]  # what client 0 starts from (every client can make it)
model = FSDP(mlp(seed=rank), device_mesh=mesh, sync_module_states=sync)
weights = [DTensor.from_tf(w.value.read_value()).full_tensor().numpy() for w in model.weights]
same = all(np.array_equal(a, b) for a, b in zip(weights, client_0))
assert same == sync, (sync, same)  # without the flag the shards mix both clients' inits
print(f"OK rank {rank} sync={sync} equals client 0's init: {same}", flush=True)
tfdist.barrier()
