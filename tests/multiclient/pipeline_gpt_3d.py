"""A GPT (tfdist.models.GPT) trained 3-D at pod shape, and its checkpoint across pipelined and plain models.

    tfdist run --nproc-per-node 4 --devices-per-proc 2 pipeline_gpt_3d.py train <ckpt>   # pp x (FSDP x TP)
    tfdist run --nproc-per-node 1 --devices-per-proc 8 pipeline_gpt_3d.py single <ckpt> <ckpt2>
    tfdist run --nproc-per-node 4 --devices-per-proc 2 pipeline_gpt_3d.py reload <ckpt2>
    tfdist run --nproc-per-node 4 --devices-per-proc 1 pipeline_gpt_3d.py one-device

train: pp = 2 stage groups, each a (dp, tp) = 2 x 2 sub-mesh spanning 2 clients, the GPT plan over tp and
FSDP over dp inside every stage. For each schedule (SCHEDULES, comma-separated, selects some), STEPS Adam
steps (float64): the losses and every stage's weights equal the whole GPT's trained on one device on the
whole batch. The last schedule's stages save their state dicts into <ckpt> (each client its own shards).
single: one client, the un-pipelined GPT on a 4 x 2 (dp, tp) mesh, loads <ckpt>: the one-device weights
after STEPS steps; then one more Adam step, saved into <ckpt2> with the weights as numpy in <ckpt2>.npz.
reload: the 4 clients' pipeline stages load <ckpt2>: the single client's weights (first, placements of
stages spanning clients that cannot run are refused on every client); then the bytes of a boundary between
congruent sub-meshes (shard-wise) and between meshes of different shapes (whole tensors).
one-device: the shard-wise boundary with one device per client, each client one torch rank.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfdist  # noqa: E402
import tfdist.checkpoint as dcp  # noqa: E402
from tfdist import pipelining as P  # noqa: E402
from tfdist.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from tfdist.device_mesh import DeviceMesh  # noqa: E402
from tfdist.fsdp import fully_shard  # noqa: E402
from tfdist.models import GPT, parallelize_gpt, split_gpt  # noqa: E402

keras.config.set_floatx("float64")
keras.config.set_dtype_policy("float64")
tfdist.init_process_group()
rank, mode = tfdist.get_rank(), sys.argv[1]
VOCAB, SEQ, DIM, HEADS, DEPTH, BATCH, STEPS = 32, 8, 16, 2, 4, 8, int(os.environ.get("STEPS", "10"))
rng = np.random.default_rng(0)
x = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype("int32")
y = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype("int32")


def gpt() -> GPT:
    """The same GPT on every client: seeded weights, built on the client's CPU."""
    keras.utils.set_random_seed(0)
    with tf.device("CPU:0"):
        model = GPT(VOCAB, SEQ, DIM, HEADS, DEPTH, name="gpt")
        model(x[:1])
    return model


def cross_entropy(logits, target):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, logits, from_logits=True))


def dense(grads):
    """Keras' Adam steps an IndexedSlices gradient with a repeated row differently from its dense form
    (v sums the squared slices); torch's embedding gradient is dense, and so is the pipeline's."""
    return [tf.convert_to_tensor(g) for g in grads]


def full(t):
    """A tensor's whole value as numpy (every client of its mesh gathers a sharded one, in one order)."""
    t = tf.convert_to_tensor(t)
    if dtensor.is_dtensor(t):
        layout = dtensor.fetch_layout(t)
        if not layout.is_fully_replicated():
            t = dtensor.relayout(t, dtensor.Layout.replicated(layout.mesh, t.shape.rank))
        t = dtensor.unpack(t)[0]
    return t.numpy()


def full_weights(model):
    """The model's weights by name, whole, as numpy (every client of its mesh gathers, in one order)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: np.asarray(v) for k, v in sd.items()}


def adam_steps(model, steps):
    """The whole GPT on one device, ``steps`` Adam steps on the whole batch: losses, weights by name."""
    opt, losses = keras.optimizers.Adam(1e-2), []
    with tf.device("CPU:0"):
        for _ in range(steps):
            with tf.GradientTape() as tape:
                loss = cross_entropy(model(x), y)
            opt.apply(dense(tape.gradient(loss, model.trainable_variables)), model.trainable_variables)
            losses.append(float(loss))
    return losses, {k: np.asarray(v) for k, v in get_model_state_dict(model).items()}


def pipeline_stages(num_stages, group_of, **stage_kwargs):
    """Every client builds both stage groups' sub-meshes (in one order) and the stages of its own group."""
    subs = [DeviceMesh("cpu", [[4 * g, 4 * g + 1], [4 * g + 2, 4 * g + 3]], mesh_dim_names=("dp", "tp"))
            for g in range(2)]
    parts, stages = split_gpt(gpt(), num_stages), []
    for i, part in enumerate(parts):
        if group_of(i) == rank // 2:
            sub = subs[group_of(i)]
            parallelize_gpt(part, sub, loss_parallel=False)
            fully_shard(part, mesh=sub["dp"])
            stages.append(P.PipelineStage(part, i, num_stages, sub, **stage_kwargs))
    return stages


def check_weights(stages, want, what):
    for st in stages:
        for key, value in full_weights(st.submod).items():
            np.testing.assert_allclose(value, want[key], rtol=1e-8, atol=1e-10, err_msg=f"{what} {key}")


def boundary_bytes(name, meshes, names, second_names=None):
    """The bytes a stage boundary carries: two Dense stages with FSDP over dp (outputs sharded over dp),
    stage g on ``meshes[g]`` held by clients 2g and 2g+1, a 16 x 8 float64 batch in 4 microbatches. Client
    pairs holding the same coordinates of congruent sub-meshes carry their dp half shard-wise, other pairs
    the whole tensor. Outputs and gradients equal numpy's either way."""
    xb, yb = rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    kernels = [rng.standard_normal((8, 8)) / 3 for _ in range(2)]
    h = np.tanh(xb @ kernels[0])
    dy = 2 * (h @ kernels[1] - yb) / (yb.size / 4)  # the loss is a mean per microbatch, summed over 4
    want_grads = [xb.T @ (dy @ kernels[1].T * (1 - h ** 2)), h.T @ dy]
    subs = [DeviceMesh("cpu", meshes[0], mesh_dim_names=names),
            DeviceMesh("cpu", meshes[1], mesh_dim_names=second_names or names)]
    g = rank // 2
    part = keras.layers.Dense(8, use_bias=False, activation="tanh" if g == 0 else None)
    part.build((None, 8))
    part.kernel.assign(kernels[g])
    fully_shard(part, mesh=subs[g]["dp"])
    stage = P.PipelineStage(part, g, 2, subs[g])
    schedule = P.ScheduleGPipe(stage, n_microbatches=4,
                               loss_fn=lambda out, t: tf.reduce_mean((out - t) ** 2), scale_grads=False)
    schedule.p2p_timeout = schedule.stall_timeout = 120.0
    out = schedule.step(*((xb,) if g == 0 else ()), target=yb if g == 1 else None)
    if g == 1:
        np.testing.assert_allclose(full(out), h @ kernels[1], rtol=1e-12)
    np.testing.assert_allclose(full(stage.grads[0]), want_grads[g], rtol=1e-10, err_msg=name)
    sent = sum(ch.bytes_sent for ch, _, _ in schedule._channel_list())
    print(f"OK rank {rank} {name} boundary bytes sent {sent}", flush=True)


# schedule -> (number of stages, stage -> stage group)
SINGLE, LOOPED, V_SHAPE = (2, lambda i: i), (4, lambda i: i % 2), (4, lambda i: min(i, 3 - i))
SCHEDULES = {
    "GPipe": (P.ScheduleGPipe, SINGLE), "1F1B": (P.Schedule1F1B, SINGLE),
    "Interleaved1F1B": (P.ScheduleInterleaved1F1B, LOOPED), "LoopedBFS": (P.ScheduleLoopedBFS, LOOPED),
    "InterleavedZeroBubble": (P.ScheduleInterleavedZeroBubble, LOOPED),
    "ZBVZeroBubble": (P.ScheduleZBVZeroBubble, V_SHAPE), "DualPipeV": (P.ScheduleDualPipeV, V_SHAPE),
}

if mode == "train":
    ref_losses, ref_weights = adam_steps(gpt(), STEPS)
    for name in os.environ.get("SCHEDULES", ",".join(SCHEDULES)).split(","):
        cls, (num_stages, group_of) = SCHEDULES[name]
        stages = pipeline_stages(num_stages, group_of)
        schedule = cls(stages, n_microbatches=4, loss_fn=cross_entropy)
        schedule.p2p_timeout = schedule.stall_timeout = 300.0  # a hang fails the test, naming its ranks
        opts = [keras.optimizers.Adam(1e-2) for _ in stages]
        first, last = stages[0].stage_index == 0, any(st.is_last for st in stages)
        for step in range(STEPS):
            for st in stages:
                st.zero_grads()
            losses = []
            schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
            for st, opt in zip(stages, opts):
                opt.apply(dense(st.grads), st.submod.trainable_variables)
            if last:
                np.testing.assert_allclose(np.mean([full(v) for v in losses]), ref_losses[step], rtol=1e-9,
                                           err_msg=f"{name} step {step}")
        check_weights(stages, ref_weights, name)
        sent = sum(ch.bytes_sent for ch, _, _ in schedule._channel_list())
        print(f"OK rank {rank} {name} stages {[st.stage_index for st in stages]} {STEPS} steps, "
              f"loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}, bytes sent {sent}", flush=True)
    dcp.save({"model": {k: v for st in stages for k, v in get_model_state_dict(st.submod).items()}},
             checkpoint_id=sys.argv[2])
    print(f"OK rank {rank} saved", flush=True)
elif mode == "single":
    _, want = adam_steps(gpt(), STEPS)
    mesh = tfdist.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    model = gpt()
    parallelize_gpt(model, mesh, loss_parallel=False)
    fully_shard(model, mesh=mesh["dp"])
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=sys.argv[2])
    set_model_state_dict(model, state["model"])
    for key, value in full_weights(model).items():
        np.testing.assert_allclose(value, want[key], rtol=1e-8, atol=1e-10, err_msg=key)
    # one more step, on the plain model, then back to the pipeline
    with tf.device("CPU:0"):
        plain = gpt()
        set_model_state_dict(plain, want)
        _, after = adam_steps(plain, 1)
    set_model_state_dict(model, after)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=sys.argv[3])
    np.savez(sys.argv[3] + ".npz", **after)
    print(f"OK single loaded {len(want)} tensors, saved", flush=True)
elif mode == "reload":
    # placements refused on every client, before any program runs: neighbouring stages on different
    # numbers of clients, and a client holding stages of two pipeline ranks
    def refusal(meshes, stage_of_client, cls):
        built = [DeviceMesh("cpu", m, mesh_dim_names=("dp", "tp")) for m in meshes]
        mine = [P.PipelineStage(keras.layers.Dense(4), i, len(meshes), built[i]) for i in stage_of_client[rank]]
        try:
            cls(mine, n_microbatches=4, loss_fn=cross_entropy)
        except ValueError as e:
            return str(e)
        raise AssertionError(f"placement {meshes} was accepted")

    uneven = refusal([[[0, 1], [2, 3]], [[4, 5]], [[6, 7]]], [[0], [0], [1], [2]], P.ScheduleGPipe)
    assert "stages 0 and 1 are on clients [0, 1] and [2]" in uneven, uneven
    two_ranks = refusal([[[0], [2]], [[1], [3]], [[4], [6]], [[5], [7]]], [[0, 1], [0, 1], [2, 3], [2, 3]],
                        P.ScheduleGPipe)
    assert "client 0 holds stages of pipeline ranks [0, 1]" in two_ranks, two_ranks
    print(f"OK rank {rank} refuses bad placements", flush=True)
    stages = pipeline_stages(*SCHEDULES["Interleaved1F1B"][1])
    state = {"model": {k: v for st in stages for k, v in get_model_state_dict(st.submod).items()}}
    dcp.load(state, checkpoint_id=sys.argv[2])
    for st in stages:
        set_model_state_dict(st.submod, {k: v for k, v in state["model"].items()
                                         if k in get_model_state_dict(st.submod)})
    want = dict(np.load(sys.argv[2] + ".npz"))
    check_weights(stages, want, "reload")
    print(f"OK rank {rank} reloaded stages {[st.stage_index for st in stages]}", flush=True)

    boundary_bytes("congruent", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ("dp", "tp"))
    boundary_bytes("1-D", [[[0, 1], [2, 3]], [4, 5, 6, 7]], ("dp", "tp"), ("dp",))
elif mode == "one-device":  # 4 clients x 1 device: each client is one torch rank
    boundary_bytes("one device per client", [[0, 1], [2, 3]], ("dp",))
tfdist.barrier()
