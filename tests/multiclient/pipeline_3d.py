"""Run under `tfdist run --nproc-per-node 4 --devices-per-proc 2`: pp = 2 stage groups, each on a 2 x 2
(dp, tp) sub-mesh spanning 2 clients, tensor parallel over tp and FSDP over dp inside every stage.

Every client builds both sub-meshes (torch's new_group rule) and the stages of its own sub-mesh. For each
schedule, 3 Adam steps (float64): every stage's weights, the losses and the output must equal the whole
model's trained on one device on the whole batch. SCHEDULES (comma-separated names) selects schedules.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfdist  # noqa: E402
from tfdist import pipelining as P  # noqa: E402
from tfdist.device_mesh import DeviceMesh  # noqa: E402
from tfdist.fsdp import fully_shard  # noqa: E402
from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

keras.config.set_floatx("float64")
keras.config.set_dtype_policy("float64")
tfdist.init_process_group()
rank = tfdist.get_rank()
# every client builds every stage group's sub-mesh, in the same order
SUBS = [DeviceMesh("cpu", [[4 * g, 4 * g + 1], [4 * g + 2, 4 * g + 3]], mesh_dim_names=("dp", "tp"))
        for g in range(2)]
MY_GROUP = rank // 2
BATCH, WIDTH, STEPS = 16, 8, 3
rng = np.random.default_rng(0)
x, y = rng.normal(size=(BATCH, WIDTH)), rng.normal(size=(BATCH, WIDTH))


def block(i):
    keras.utils.set_random_seed(i)
    return keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(16, activation="tanh", name="up"),
                             keras.layers.Dense(WIDTH, name="down")], name=f"block{i}")


def mse(out, target):
    return tf.reduce_mean((out - target) ** 2)


def full(t):
    """A DTensor's whole value (every client of its mesh calls this in the same order)."""
    t = tf.convert_to_tensor(t)
    if dtensor.is_dtensor(t):
        t = dtensor.relayout(t, dtensor.Layout.replicated(dtensor.fetch_layout(t).mesh, t.shape.rank))
        t = dtensor.unpack(t)[0]
    return t.numpy()


def reference(num_stages):
    """The whole model on one device, STEPS Adam steps on the whole batch: losses, output, weights."""
    with tf.device("CPU:0"):
        model = keras.Sequential([keras.Input((WIDTH,))] + [block(i) for i in range(num_stages)])
        opt, losses = keras.optimizers.Adam(1e-2), []
        for _ in range(STEPS):
            with tf.GradientTape() as tape:
                out = model(x)
                loss = mse(out, y)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            losses.append(float(loss))
        return losses, out.numpy(), [[v.numpy() for v in model.layers[i].trainable_variables]
                                     for i in range(num_stages)]


# schedule -> (number of stages, stage -> stage group)
SINGLE, LOOPED, V_SHAPE = (2, lambda i: i), (4, lambda i: i % 2), (4, lambda i: min(i, 3 - i))
SCHEDULES = {
    "GPipe": (P.ScheduleGPipe, SINGLE), "1F1B": (P.Schedule1F1B, SINGLE),
    "Interleaved1F1B": (P.ScheduleInterleaved1F1B, LOOPED), "LoopedBFS": (P.ScheduleLoopedBFS, LOOPED),
    "InterleavedZeroBubble": (P.ScheduleInterleavedZeroBubble, LOOPED),
    "ZBVZeroBubble": (P.ScheduleZBVZeroBubble, V_SHAPE), "DualPipeV": (P.ScheduleDualPipeV, V_SHAPE),
}
for name in os.environ.get("SCHEDULES", ",".join(SCHEDULES)).split(","):
    cls, (num_stages, group_of) = SCHEDULES[name]
    ref_losses, ref_out, ref_weights = reference(num_stages)
    stages = []
    for i in (i for i in range(num_stages) if group_of(i) == MY_GROUP):
        part, sub = block(i), SUBS[MY_GROUP]
        parallelize_module(part, sub["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(part, mesh=sub["dp"])
        stages.append(P.PipelineStage(part, i, num_stages, sub))
    schedule = cls(stages, n_microbatches=4, loss_fn=mse)
    schedule.p2p_timeout = schedule.stall_timeout = 120.0  # a hang fails the test in two minutes
    opts = [keras.optimizers.Adam(1e-2) for _ in stages]
    last = any(st.is_last for st in stages)
    for step in range(STEPS):
        for st in stages:
            st.zero_grads()
        losses = []
        out = schedule.step(*((x,) if stages[0].stage_index == 0 else ()), target=y if last else None,
                            losses=losses)
        for st, opt in zip(stages, opts):
            opt.apply(st.grads, st.submod.trainable_variables)
        if last:
            np.testing.assert_allclose(np.mean([full(v) for v in losses]), ref_losses[step], rtol=1e-10,
                                       err_msg=name)
    if last:
        np.testing.assert_allclose(full(out), ref_out, rtol=1e-10, atol=1e-12, err_msg=name)
    for st in stages:
        for got, want in zip(st.submod.get_weights(), ref_weights[st.stage_index]):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11, err_msg=name)
    sent = sum(ch.bytes_sent for ch, _, _ in schedule._channel_list())
    print(f"OK rank {rank} {name} stages {[st.stage_index for st in stages]} bytes sent {sent}", flush=True)
tfdist.barrier()
