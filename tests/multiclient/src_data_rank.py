"""Run under `tfdist run`: each client passes a different value; src_data_rank picks whose counts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

world = int(os.environ["WORLD_SIZE"])
rank = tfdist.get_rank()
mesh = tfdist.init_device_mesh("cpu", (2, world), mesh_dim_names=("dp", "tp"))


def value_of(r):
    return np.arange(4 * 2 * world, dtype=np.float32).reshape(4, 2 * world) + 100 * r


mine = value_of(rank)
for src in range(world):
    d = distribute_tensor(mine, mesh, [Shard(0), Shard(1)], src_data_rank=src)
    np.testing.assert_array_equal(d.full_tensor().numpy(), value_of(src))  # every client: src's value
    flags = distribute_tensor(mine > 150, mesh, [Replicate(), Replicate()], src_data_rank=src)
    np.testing.assert_array_equal(flags.full_tensor().numpy(), value_of(src) > 150)
own = distribute_tensor(mine, mesh, [Replicate(), Replicate()], src_data_rank=None)
for local in own.local_tensors():  # torch's None: this client's devices hold its own value
    np.testing.assert_array_equal(local.numpy(), mine)
tfdist.barrier()
print(f"OK rank {rank}", flush=True)
