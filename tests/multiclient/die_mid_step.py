"""Rank 1 is killed in the middle of training; the others block in a collective."""

import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

mesh = tfdist.init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]) * 2,), mesh_dim_names=("x",))
x = distribute_tensor(np.ones((64, 4), np.float32), mesh, [Shard(0)])
for step in range(1000):
    if step == 3 and tfdist.get_rank() == 1:
        print("rank 1 dies now", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    x.redistribute(mesh, [Replicate()]).numpy()
print("unreachable: training finished", flush=True)
