"""Why a pipeline stage whose sub-mesh spans clients is refused today, and the route that works (TF 2.21).

    python -m tfdist.run --nproc-per-node 4 --devices-per-proc 2 docs/tf_dtensor_repros/stage_mesh_across_clients.py
    MODE=lockstep python -m tfdist.run --nproc-per-node 4 --devices-per-proc 2 docs/tf_dtensor_repros/stage_mesh_across_clients.py

pp = 2 stages of 4 devices, each stage's mesh spanning 2 of the 4 clients:
clients 0, 1 hold mesh A (global devices 0-3), clients 2, 3 mesh B (4-7).

MODE=diverge (default): each client runs only its own stage's ops, as a torch
rank does.  Both halves' first all-reduce gets group key 0 and TF's collective
group leader (one per cluster) refuses the second half: "Device ... is joining a
group that is already full (group_key=0)".  DTensor derives a collective's
group key from a per-process counter bumped at every lowering
(tensorflow/dtensor/mlir/collectives.cc, ``GetCollectiveKeyBase``:
``static std::atomic<int32> tf_collective_key_base{0}`` ...
``return tf_collective_key_base++``) plus the group's offset in the mesh, and its
instance key from another counter (``tf_collective_instance_key_base++``), on
the stated assumption that "different hosts go through exactly the same MLIR
logic".  Clients that lower different programs therefore give different groups
the same key.  Depending on timing the clash may instead let the two halves'
all-reduces meet in one group: no error, and some clients print a wrong value
("correct: False") -- seen in a CI run on a 2-core machine -- or cancel one
client pair's collective ("Function was cancelled before it was started"),
also seen in CI.

MODE=lockstep: every client builds both meshes (the other half's as a remote
mesh: no local devices) and issues the same ops in the same order; DTensor
lowers the remote ones (so every counter agrees) and skips their execution.
Both stages compute the right values.  That is the route for stages that
span clients: all clients issue every stage's DTensor ops in one global
order (remote ones are no-ops), with the boundary transfers in that order.

Exit status 1 if a stage computes a wrong value; in diverge mode the refused
collective raises (exit 1 on the clients that see it).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfdist  # noqa: E402

tfdist.init_process_group()
rank = tfdist.get_rank()
mine = rank // 2  # the stage (half) this client's devices belong to
local = dtensor.local_devices("CPU")


def stage_mesh(half: int) -> dtensor.Mesh:
    names = [f"/job:worker/replica:0/task:{2 * half + j // 2}/device:CPU:{j % 2}" for j in range(4)]
    if half == mine:
        first = 4 * half + 2 * (rank % 2)
        return dtensor.Mesh(["x"], np.arange(4) + 4 * half, [first, first + 1], local, global_devices=names)
    return dtensor.Mesh(["x"], np.arange(4) + 4 * half, [], [], global_devices=names)  # remote


def stage_op(mesh: dtensor.Mesh, half: int):
    a = np.arange(16.0).reshape(4, 4) + half
    sharded = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(a), dtensor.Layout.replicated(mesh, 2)),
                               dtensor.Layout(["unsharded", "x"], mesh))
    return a, tf.reduce_sum(sharded, axis=1)  # an all-reduce over the stage's 4 devices


lockstep = os.environ.get("MODE", "diverge") == "lockstep"
halves = [0, 1] if lockstep else [mine]
results = {h: stage_op(stage_mesh(h), h) for h in halves}
a, total = results[mine]
ok = np.allclose(dtensor.unpack(total)[0].numpy(), a.sum(1))
print(f"rank {rank} ({'lockstep' if lockstep else 'diverge'}): stage {mine}'s all-reduce correct: {ok}", flush=True)
raise SystemExit(0 if ok else 1)
