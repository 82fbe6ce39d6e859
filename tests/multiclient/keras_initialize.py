"""keras.distribution.initialize on TF, then a ModelParallel fit; run under `tfdist run`.

    python keras_initialize.py OUT.npz

The launcher's DTENSOR_* variables are read here and removed, so only Keras'
arguments (or, with `env`, Keras' own KERAS_DISTRIBUTION_* variables) start
the multi-client runtime. Rank 0 writes the losses to OUT.npz.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
jobs = os.environ.pop("DTENSOR_JOBS")
world = int(os.environ.pop("DTENSOR_NUM_CLIENTS"))
rank = int(os.environ.pop("DTENSOR_CLIENT_ID"))
via = sys.argv[2] if len(sys.argv) > 2 else "args"
import numpy as np  # noqa: E402
import keras  # noqa: E402

import tfdist  # noqa: E402
import tfdist.keras  # noqa: E402,F401

if via == "env":
    os.environ.update(KERAS_DISTRIBUTION_JOB_ADDRESSES=jobs, KERAS_DISTRIBUTION_NUM_PROCESSES=str(world),
                      KERAS_DISTRIBUTION_PROCESS_ID=str(rank))
    keras.distribution.initialize()
else:
    keras.distribution.initialize(job_addresses=jobs, num_processes=world, process_id=rank)
assert tfdist.get_world_size() == world and tfdist.get_rank() == rank

devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((2, len(devices) // 2), ["batch", "model"], devices=devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*up/kernel"] = (None, "model")
layout_map[".*down/kernel"] = ("model", None)
# every client feeds the same global batch (tfdist places each client's slices)
keras.distribution.set_distribution(keras.distribution.ModelParallel(
    layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False))
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="up"), keras.layers.Dense(8, name="down")])
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 16)).astype("float32"), rng.standard_normal((64, 8)).astype("float32")
history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
if rank == 0:
    np.savez(sys.argv[1], loss=np.array(history.history["loss"]), *model.get_weights())
print(f"done rank {rank} of {world} devices {len(devices)}", flush=True)
