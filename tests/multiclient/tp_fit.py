"""Tensor-parallel (and/or FSDP) model.fit; run under `tfdist run` or alone (with virtual CPUs).

    python tp_fit.py OUT.npz TOTAL_DEVICES [tp|fsdp|fsdp+tp|fsdp+offload|hsdp]

Rank 0 writes the final weights and the loss history to OUT.npz.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tfdist  # noqa: E402

out_path, total = sys.argv[1], int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "tp"
if "WORLD_SIZE" not in os.environ:
    tfdist.virtual_cpus(total)  # the single-process reference: same global mesh
import keras  # noqa: E402

from tfdist.fsdp import CPUOffloadPolicy, fully_shard  # noqa: E402
from tfdist.models import MLP, mlp_tp_plan  # noqa: E402
from tfdist.tensor.parallel import parallelize_module  # noqa: E402

mesh = tfdist.init_device_mesh("cpu", (2, total // 2), mesh_dim_names=("dp", "tp"))
keras.utils.set_random_seed(0)
model = MLP(16, 32)
model(np.zeros((1, 16), "float32"))
if "tp" in mode:
    parallelize_module(model, mesh["tp"], mlp_tp_plan())
if mode == "fsdp":  # one data-parallel dim over every device of every client
    fully_shard(model, mesh=tfdist.init_device_mesh("cpu", (total,), mesh_dim_names=("dp",)))
elif mode == "fsdp+tp":
    fully_shard(model, mesh=mesh["dp"])
elif mode == "hsdp":  # parameters sharded over "shard", replica groups over "replicate", across clients
    fully_shard(model, mesh=tfdist.init_device_mesh("cpu", (2, total // 2), mesh_dim_names=("replicate", "shard")))
elif mode == "fsdp+offload":  # shards on each client's host mesh between steps, Adam run there
    fully_shard(model, mesh=tfdist.init_device_mesh("cpu", (total,), mesh_dim_names=("dp",)),
                offload_policy=CPUOffloadPolicy())
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 16)).astype("float32")
y = rng.standard_normal((64, 16)).astype("float32")
history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
weights = model.get_weights()
if tfdist.get_rank() == 0:
    np.savez(out_path, loss=np.array(history.history["loss"]), *weights)
print(f"done rank {tfdist.get_rank()} loss {history.history['loss'][-1]:.6f}", flush=True)
