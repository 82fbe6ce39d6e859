"""Run under `tfdist run`: every rank checks DTensor values against numpy."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tfdist.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

world = int(os.environ["WORLD_SIZE"])
mesh = tfdist.init_device_mesh("cpu", (2, world), mesh_dim_names=("dp", "tp"))
rank = tfdist.get_rank()
x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
c = -(-12 // world)
for local, (i, j) in zip(d.local_tensors(), mesh.local_coordinates()):
    np.testing.assert_array_equal(local.numpy(), x[4 * i: 4 * (i + 1), c * j: c * (j + 1)])
np.testing.assert_array_equal(d.full_tensor().numpy(), x)
e = d.redistribute(mesh, [Replicate(), Shard(0)])
np.testing.assert_array_equal(e.numpy(), x)
y = (d @ distribute_tensor(np.ones((12, 3), np.float32), mesh, [Replicate(), Shard(0)]))
np.testing.assert_allclose(y.numpy(), x @ np.ones((12, 3)), rtol=1e-6)
tfdist.barrier()
print(f"OK rank {rank} of {tfdist.get_world_size()} clients, {len(mesh.local_devices())} local devices, "
      f"mesh {mesh.shape}", flush=True)
