"""``tfdist demo``: the library end to end on 8 virtual CPUs, in about two minutes.

1. DTensor: placements, ``redistribute`` and the collective each move runs.
2. A GPT trained with ``model.fit``, sharded 2-D (tensor parallel on ``tp`` x FSDP on
   ``dp``), on a task it visibly learns; where a few weights live; the collectives of one
   step with their bytes.
3. A distributed checkpoint of it, loaded onto other meshes (FSDP over all 8 devices, and one
   device): the same evaluation loss.
4. A 1F1B pipeline over 4 stages: the plan, the executed timeline, gradients equal to the
   whole model's.
5. Pictures (loss curve, pipeline timeline) in an output folder named at the end.

Every claim it prints is also checked here (``DemoError`` if one fails), and the test of the
demo reads them back (tests/test_cli.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tfdist
import tfdist.checkpoint as dcp
import tfdist.keras
from tfdist.checkpoint.state_dict import get_state_dict, set_state_dict
from tfdist.fsdp import fully_shard
from tfdist.keras import _data
from tfdist.models import GPT, gpt_tp_plan
from tfdist.pipelining import PipelineStage, Schedule1F1B
from tfdist.pipelining._actions import format_pipeline_order
from tfdist.pipelining._plot import plot_schedule, timeline
from tfdist.pipelining._timeline import bubble_fraction
from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tfdist.tensor.debug import CommDebugMode, explain_redistribute, visualize_sharding
from tfdist.tensor.parallel import parallelize_module

__all__ = ["DemoError", "DemoResult", "run_demo"]


class DemoError(AssertionError):
    """A claim the demo prints turned out false (a bug: please report it)."""
@dataclass
class DemoResult:
    """What the demo measured, for the test and for ``--json``-style reuse."""
    losses: list[float] = field(default_factory=list)  # training loss per epoch
    eval_losses: dict[str, float] = field(default_factory=dict)  # mesh -> evaluation loss
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_demo(mesh_shape: tuple[int, int] = (2, 4), steps: int = 100, out_dir: str = "tfdist-demo",
             skip_keras: bool = False) -> DemoResult:
    """Runs the demo; ``mesh_shape`` is the (dp, tp) mesh of 8 devices, ``steps`` the training steps.

    Example::

        from tfdist._demo import run_demo
        result = run_demo((4, 2), steps=20, out_dir="/tmp/demo")
        result.eval_losses   # {'dp x tp (4, 2)': 2.1, 'FSDP over 8': 2.1, 'one device': 2.1}
    """

    start = time.perf_counter()
    tfdist.virtual_cpus(8)
    if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != 8 or min(mesh_shape) < 1:
        raise ValueError(f"mesh_shape must be two sizes whose product is 8 (dp, tp). Received: mesh_shape={mesh_shape!r}")
    if steps < 5:
        raise ValueError(f"steps must be at least 5 (one per epoch). Received: steps={steps!r}")
    mesh = tfdist.init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("dp", "tp"))
    result = DemoResult()
    os.makedirs(out_dir, exist_ok=True)
    _dtensor_part(mesh)
    if not skip_keras:
        _keras_part(mesh, steps, out_dir, result)
    _pipeline_part(out_dir, result)
    result.seconds = time.perf_counter() - start
    print(f"\n== done in {result.seconds:.0f} s; pictures and checkpoint in {os.path.abspath(out_dir)}")
    for path in result.files:
        print(f"   {path}")
    return result


def _section(title: str) -> None:
    print(f"\n{'=' * 8} {title}")


def _dtensor_part(mesh: Any) -> None:
    """Placements and moves: each redistribute names the collective TF runs for it."""
    _section("1. DTensor")
    print(f"mesh: {mesh}\n")
    x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    a = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    visualize_sharding(a, header="== distribute_tensor(x[6, 8], mesh, [Shard(0), Shard(1)])")

    def move(src: DTensor, placements: list, title: str) -> DTensor:
        steps = explain_redistribute(src, mesh, placements)
        moved = src.redistribute(mesh, placements)
        print(f"\n== {title}")
        for step in steps:
            print(f"   {step}")
        visualize_sharding(moved)
        np.testing.assert_allclose(moved.numpy(), src.numpy())
        return moved

    b = move(a, [Replicate(), Shard(0)], "redistribute -> [Replicate(), Shard(0)]")
    move(b, [Replicate(), Replicate()], "redistribute -> [Replicate(), Replicate()]")
    move(a, [Shard(1), Shard(0)], f"redistribute -> [Shard(1), Shard(0)] (uneven: 6 rows on {mesh.size(1)} devices)")

    # device (dp, tp) holds the value tp: replicas along dp agree, as they must
    tp = mesh.size(1)
    parts = [tf.fill((2, 8), float(i % tp)) for i in range(mesh.size())]
    p = DTensor.from_local(parts, mesh, [Replicate(), Partial("sum")])
    print("\n== DTensor.from_local(device (dp, tp) holds tp, [Replicate(), Partial('sum')])")
    visualize_sharding(p)
    r = move(p, [Replicate(), Shard(0)], "redistribute Partial -> Shard(0)")
    print(f"   value: {r.numpy()[0, 0]:.0f} = {'+'.join(str(i) for i in range(tp))}")

    w = distribute_tensor(np.ones((8, 4), np.float32), mesh, [Replicate(), Shard(0)])
    h = distribute_tensor(np.ones((6, 8), np.float32), mesh, [Shard(0), Shard(1)])
    y = tf.function(lambda h, w: tf.nn.relu(tf.matmul(h, w)))(h, w)
    print(f"\n== tf.function matmul, contraction dim sharded on tp: result {y.placements}, "
          f"value {y.numpy()[0, 0]:.0f} (= 8)")


# -- the Keras part -------------------------------------------------------------------------------

_VOCAB, _SEQ = 64, 16


def _task(n: int, seed: int) -> tuple[Any, Any]:
    """Counting sequences with a random start and stride; the target is the next number.

    The next token depends on the stride, which only the previous tokens show: the model must
    attend, and its loss falls from ln(64) = 4.16 towards 0 as it learns to.
    """

    rng = np.random.default_rng(seed)
    start = rng.integers(0, _VOCAB, (n, 1))
    stride = rng.integers(1, 4, (n, 1))
    seq = (start + stride * np.arange(_SEQ + 1)) % _VOCAB
    return seq[:, :-1].astype("int32"), seq[:, 1:].astype("int32")


def _gpt(seed: int) -> Any:


    keras.utils.set_random_seed(seed)
    model = GPT(_VOCAB, _SEQ, dim=64, heads=4, depth=2)
    model(_task(1, 0)[0])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _keras_part(mesh: Any, steps: int, out_dir: str, result: DemoResult) -> None:


    batch, epochs = 32, 5
    per_epoch = steps // epochs
    x, y = _task(batch * per_epoch, seed=0)
    x_eval, y_eval = _task(128, seed=1)

    _section(f"2. A GPT trained with model.fit, tensor parallel on tp x FSDP on dp, mesh {mesh.shape}")
    model = _gpt(0)
    parallelize_module(model, mesh["tp"], gpt_tp_plan())  # tensor parallel first ...
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])  # ... then FSDP over dp, one group per block
    fully_shard(model, mesh=mesh["dp"])
    print(f"task: continue counting sequences (start, stride random) over a {_VOCAB}-token vocabulary, "
          f"{steps} steps of batch {batch}")
    batch_losses: list[float] = []
    running: list[float] = [0.0]  # Keras logs the epoch's running mean; the curve wants each batch's loss

    def record_loss(index: int, logs: dict) -> None:
        mean = float(logs["loss"])
        batch_losses.append((index + 1) * mean - index * (running[0] if index else 0.0))
        running[0] = mean

    record = keras.callbacks.LambdaCallback(on_train_batch_end=record_loss)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=2, callbacks=[record])
    result.losses = [float(v) for v in history.history["loss"]]
    print(f"   model.fit loss per epoch: {', '.join(f'{v:.3f}' for v in result.losses)}")
    if not result.losses[-1] < result.losses[0]:
        raise DemoError(f"the loss did not fall: {result.losses}")

    print("\n== where a few weights live (tfdist.keras.summary; dp and tp are the mesh dims)")
    lines = tfdist.keras.summary(model, print_fn=lambda _: None).splitlines()
    block = model.blocks[0]
    shown = [v.path for v in (model.tok.embeddings, block.attn._query_dense.kernel, block.mlp.up.kernel,
                              block.mlp.down.kernel, model.head.kernel)]
    picked = [ln for ln in lines[1:-1] if ln.split(" ")[0] in shown]
    for ln in [lines[0], *picked, lines[-1]]:
        print(f"   {ln}")
    whole = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.variables)
    print(f"   (one device would hold {whole:,} bytes)")

    step = model.make_train_function()
    data = iter([_data.shard_batch((tf.constant(x[:batch]), tf.constant(y[:batch])), mesh, 0)])
    with CommDebugMode() as comm:
        step(data)
    counts, sent = comm.get_comm_counts(), comm.get_comm_bytes()
    print("\n== collectives in one training step (per device, as TF ran them)")
    for name in sorted(counts):
        print(f"   {name:<28} x{counts[name]:<4} {sent.get(name, 0.0) / 1024:10.1f} KiB sent")

    _section("3. Distributed checkpoint: save on this mesh, load on others")
    where = os.path.join(out_dir, "checkpoint")
    model_sd, optim_sd = get_state_dict(model, model.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
    print(f"   saved {len(model_sd)} weights and their Adam state to {where}: each device wrote its own shards")
    label = f"dp x tp {tuple(mesh.shape)}"
    result.eval_losses[label] = float(model.evaluate(x_eval, y_eval, batch_size=32, verbose=0))
    fsdp8 = tfdist.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    other = _gpt(1)
    for block in other.blocks:
        fully_shard(block, mesh=fsdp8)
    fully_shard(other, mesh=fsdp8)
    plain = _gpt(2)  # no mesh: one device
    for name, target in (("FSDP over 8", other), ("one device", plain)):
        sd, osd = get_state_dict(target, target.optimizer)
        dcp.load({"model": sd, "optim": osd}, checkpoint_id=where)
        set_state_dict(target, target.optimizer, model_state_dict=sd, optim_state_dict=osd)
        result.eval_losses[name] = float(target.evaluate(x_eval, y_eval, batch_size=32, verbose=0))
    for name, loss in result.eval_losses.items():
        print(f"   evaluation loss, {name:<18} {loss:.6f}")
    reference = result.eval_losses[label]
    if not all(abs(v - reference) <= 1e-4 * max(1.0, abs(reference)) for v in result.eval_losses.values()):
        raise DemoError(f"the reloaded models disagree: {result.eval_losses}")

    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        print("   (no loss curve picture: pip install 'tfdist[plot]' for matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(np.arange(1, len(batch_losses) + 1), batch_losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT, model.fit on dp x tp = {tuple(mesh.shape)} (TP x FSDP)")
    fig.tight_layout()
    path = os.path.join(out_dir, "loss_curve.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    result.files.append(path)


# -- the pipeline part ----------------------------------------------------------------------------

def _pipeline_part(out_dir: str, result: DemoResult) -> None:


    _section("4. Pipeline parallelism: 4 stages, Schedule1F1B, 8 microbatches")
    width, stages_n, micro = 32, 4, 8

    def block(i: int) -> Any:
        keras.utils.set_random_seed(100 + i)
        return keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, activation="tanh")],
                                name=f"block{i}")

    def mse(out: Any, target: Any) -> Any:
        return tf.reduce_mean((out - target) ** 2)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, width)).astype("float32")
    target = rng.normal(size=(64, width)).astype("float32")
    blocks = [block(i) for i in range(stages_n)]
    stages = [PipelineStage(b, i, stages_n, f"CPU:{2 * i}") for i, b in enumerate(blocks)]
    schedule = Schedule1F1B(stages, n_microbatches=micro, loss_fn=mse)
    losses: list = []
    schedule.step(x, target=target, losses=losses)
    print("plan (one row per pipeline rank; F = forward, B = backward of a microbatch):")
    print(format_pipeline_order(schedule.pipeline_order))

    # the reference: the same blocks as one model on one device, the loss averaged over microbatches
    whole = [b.trainable_variables for b in blocks]
    with tf.GradientTape() as tape:
        h = tf.constant(x)
        for b in blocks:
            h = b(h)
        loss = tf.add_n([mse(o, t) for o, t in zip(tf.split(h, micro), tf.split(target, micro))]) / micro
    expected = tape.gradient(loss, [v for vs in whole for v in vs])
    got = [g for st in stages for g in st.grads]
    worst = max(float(tf.reduce_max(tf.abs(tf.convert_to_tensor(g) - e))) for g, e in zip(got, expected))
    print(f"   mean microbatch loss {float(np.mean([float(v) for v in losses])):.6f} "
          f"(whole model: {float(loss):.6f}); gradients differ from the whole model's by at most {worst:.1e}")
    if worst > 1e-5:
        raise DemoError(f"pipeline gradients differ from the whole model's by {worst}")
    schedule.step(x, target=target)  # the first step traced the stage programs; time the second
    executed = schedule.executed_order
    span = max(end for acts in executed.values() for _, _, end in acts)
    print(f"   executed (second step, {span * 1e3:.0f} ms): "
          + "; ".join(f"rank {r} busy {sum(e - b for _, b, e in acts) * 1e3:.0f} ms" for r, acts in executed.items()))
    print(f"   bubble: executed {bubble_fraction(executed):.2f}, plan {bubble_fraction(timeline(schedule)):.3f} "
          f"((p - 1) / (m + p - 1) = {(stages_n - 1) / (micro + stages_n - 1):.3f}); "
          "8 virtual CPUs share this machine's cores, so ranks also wait for a core")
    try:
        path = plot_schedule(schedule, os.path.join(out_dir, "pipeline_1f1b.png"), executed=True)
    except ImportError:
        print("   (no timeline picture: pip install 'tfdist[plot]' for matplotlib)")
        return
    result.files.append(path)

