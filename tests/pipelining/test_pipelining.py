"""tfdist.pipelining: plans equal to torch's, gradients equal to the un-pipelined model's, stages on
devices and tensor-parallel sub-meshes, microbatches, errors.

References: torch's pipeline_order (fixtures/torch_orders.json, made by
fixtures/generate_torch_orders.py with torch 2.13), and the same Keras model
run whole on one device (float64).
"""

from __future__ import annotations

import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_helpers import float64, no_global_distribution  # noqa: F401
from tfdist.device_mesh import DeviceMesh
from tfdist.pipelining import (
    PipelineStage, PipeliningShapeError, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
    ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble, TensorChunkSpec, merge_chunks,
    split_args_kwargs_into_chunks,
)
from tfdist.pipelining import _orders
from tfdist.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

TORCH = json.loads((pathlib.Path(__file__).parent / "fixtures" / "torch_orders.json").read_text())
PLANS = {
    "ScheduleGPipe": lambda r, pp, per, n: _orders.gpipe(r, pp, n),
    "Schedule1F1B": lambda r, pp, per, n: _orders.one_f_one_b_plan(r, pp, n),
    "ScheduleInterleaved1F1B": _orders.interleaved_1f1b,
    "ScheduleLoopedBFS": _orders.looped_bfs,
    "ScheduleInterleavedZeroBubble": lambda r, pp, per, n: _orders.interleaved_zero_bubble(pp, per, n)[r],
    "ScheduleZBVZeroBubble": lambda r, pp, per, n: _orders.zbv(r, pp, n),
    "ScheduleDualPipeV": lambda r, pp, per, n: _orders.dualpipe_v(r, pp, n),
}
CASES = [c for c in TORCH["cases"] if c["schedule"] in PLANS and "pipeline_order" in c]
RNG = np.random.default_rng(0)
X, Y = RNG.standard_normal((16, 8)), RNG.standard_normal((16, 8))


def mse(y, t):
    return tf.reduce_mean((y - t) ** 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['schedule']}-pp{c['pp']}-n{c['n_microbatches']}")
def test_plan_equals_torchs(case):
    pp, per, n = case["pp"], case["stages_per_rank"], case["n_microbatches"]
    mine = {str(r): [None if a is None else str(a) for a in PLANS[case["schedule"]](r, pp, per, n)]
            for r in range(pp)}
    assert mine == case["pipeline_order"]


def blocks(n=4, seed=0):
    keras.utils.set_random_seed(seed)
    return [keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh", name="up"),
                              keras.layers.Dense(8, name="down")], name=f"block{i}") for i in range(n)]


def whole(parts):
    return keras.Sequential([keras.Input((8,))] + parts)


def reference_grads():
    model = whole(blocks())
    with tf.GradientTape() as tape:
        loss = mse(model(X), Y)
    return loss, tape.gradient(loss, model.trainable_variables)


def stages_for(schedule, parts, **kwargs):
    if schedule in (ScheduleGPipe, Schedule1F1B):
        return [PipelineStage(b, i, 4, f"CPU:{2 * i}", **kwargs) for i, b in enumerate(parts)]
    if schedule in (ScheduleZBVZeroBubble, ScheduleDualPipeV):  # V: rank 0 holds stages 0, 3; rank 1: 1, 2
        return [PipelineStage(b, i, 4, f"CPU:{min(i, 3 - i)}", **kwargs) for i, b in enumerate(parts)]
    return [PipelineStage(b, i, 4, f"CPU:{i % 2}", **kwargs) for i, b in enumerate(parts)]  # 2 ranks x 2 stages


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
                                      ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV])
@pytest.mark.parametrize("n", [4, 8])
def test_gradients_equal_the_unpipelined_model(float64, schedule, n):
    want_loss, want = reference_grads()
    stages = stages_for(schedule, blocks())
    losses = []
    out = schedule(stages, n, loss_fn=mse).step(X, target=Y, losses=losses)
    got = [g for s in stages for g in s.grads]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    assert len(losses) == n
    np.testing.assert_allclose(np.mean([l.numpy() for l in losses]), want_loss.numpy(), rtol=1e-12)
    np.testing.assert_allclose(out.numpy(), whole(blocks())(X).numpy(), rtol=1e-12)


@pytest.mark.parametrize("schedule", [ScheduleGPipe, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble])
def test_activation_checkpoint_recomputes_and_gives_the_same_gradients(float64, schedule):
    want_loss, want = reference_grads()
    stages = stages_for(schedule, blocks(), activation_checkpoint=True)
    losses = []
    schedule(stages, 4, loss_fn=mse).step(X, target=Y, losses=losses)
    for a, b in zip([g for s in stages for g in s.grads], want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.mean([l.numpy() for l in losses]), want_loss.numpy(), rtol=1e-12)


def _matmuls_run(tmp_path, run):
    """MatMul kernels the TF profiler saw during ``run()`` (fused or not, on every compute thread)."""
    from tfdist.pipelining import read_profile

    tf.profiler.experimental.start(str(tmp_path))
    run()
    tf.profiler.experimental.stop()
    return sum(1 for _, name, _, _ in read_profile(tmp_path).kernels if name.endswith("MatMul"))


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble])
def test_backward_uses_the_kept_activations_not_a_second_forward(tmp_path, float64, schedule):
    """4 blocks x 2 Dense, 4 microbatches. Counted by hand: the un-pipelined step runs, per microbatch's
    rows, 8 forward matmuls and 15 backward ones (an input and a weight gradient per layer, no input
    gradient for the model's input): 23 x 4 = 92. A pipeline step that keeps activations runs exactly
    those; with activation_checkpoint every backward runs its stage's forward again."""
    stages = stages_for(schedule, blocks())
    pipe = schedule(stages, 4, loss_fn=mse)
    pipe.step(X, target=Y)  # compile outside the trace
    assert _matmuls_run(tmp_path / "kept", lambda: pipe.step(X, target=Y)) == 92
    stages = stages_for(schedule, blocks(), activation_checkpoint=True)
    pipe = schedule(stages, 4, loss_fn=mse)
    pipe.step(X, target=Y)
    recomputed = _matmuls_run(tmp_path / "recomputed", lambda: pipe.step(X, target=Y))
    # at least each microbatch's forward once more, less the output matmul of the 3 non-last stages,
    # which their backward does not need (TF prunes it): 5 x 4 (zero-bubble plans recompute in I and W)
    assert recomputed >= 92 + 20


class Scaled(keras.layers.Layer):
    """A first stage with a keyword input: Dense(x) * scale (+ shift, a Python float)."""

    def __init__(self):
        super().__init__(name="scaled")
        self.dense = keras.layers.Dense(8, activation="tanh")

    def call(self, x, scale=None, shift=0.0):
        return self.dense(x) * scale + shift


def _weighted_mse(y, t, weights):
    return tf.reduce_mean(weights * (y - t) ** 2)


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B, ScheduleZBVZeroBubble])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["kept", "recomputed"])
def test_keyword_inputs_and_loss_kwargs_are_split_per_microbatch(float64, schedule, checkpoint):
    """step(x, target=y, scale=s, shift=0.5, loss_kwargs={"weights": w}): per-example keyword tensors are
    cut with their microbatch, a Python value goes to every microbatch; gradients and losses equal the
    whole model's on the whole batch."""
    scale, weights = RNG.uniform(0.5, 1.5, (16, 1)), RNG.uniform(0.0, 2.0, (16, 1))
    keras.utils.set_random_seed(3)
    first, rest = Scaled(), blocks(3)
    first(X[:1], scale=scale[:1])  # built

    def run_whole():
        with tf.GradientTape() as tape:
            h = first(X, scale=scale, shift=0.5)
            for b in rest:
                h = b(h)
            loss = _weighted_mse(h, Y, weights)
        return loss, tape.gradient(loss, first.trainable_variables + [v for b in rest for v in b.trainable_variables])

    want_loss, want = run_whole()
    stages = stages_for(schedule, [first] + rest, activation_checkpoint=checkpoint)
    losses = []
    schedule(stages, 4, loss_fn=_weighted_mse).step(X, target=Y, losses=losses, scale=scale, shift=0.5,
                                                    loss_kwargs={"weights": weights})
    for a, b in zip([g for s in stages for g in s.grads], want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.mean([l.numpy() for l in losses]), want_loss.numpy(), rtol=1e-12)
    out = schedule(stages, 4).eval(X, scale=scale, shift=0.5)
    h = first(X, scale=scale, shift=0.5)
    for b in rest:
        h = b(h)
    np.testing.assert_allclose(out.numpy(), h.numpy(), rtol=1e-12)
    with pytest.raises(TypeError, match="loss_kwargs must be a dict"):
        schedule(stages, 4, loss_fn=_weighted_mse).step(X, target=Y, scale=scale, loss_kwargs=[weights])


def test_unscaled_gradients_are_the_sum_over_microbatches(float64):
    _, want = reference_grads()
    stages = stages_for(ScheduleGPipe, blocks())
    ScheduleGPipe(stages, 4, loss_fn=mse, scale_grads=False).step(X, target=Y)
    np.testing.assert_allclose(stages[0].grads[0].numpy(), 4 * want[0].numpy(), rtol=1e-12)


def train_and_compare(ref, stages, pipe, steps):
    """``steps`` Adam steps of the whole model and of the pipeline; the weights must agree."""
    ref_opt = keras.optimizers.Adam(1e-2)
    opts = [keras.optimizers.Adam(1e-2) for _ in stages]
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = mse(ref(X), Y)
        ref_opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)
        for s in stages:
            s.zero_grads()
        pipe.step(X, target=Y)
        for s, opt in zip(stages, opts):
            opt.apply(s.grads, s.submod.trainable_variables)
    got = [v.numpy() for s in stages for v in s.submod.trainable_variables]
    for a, b in zip(got, [v.numpy() for v in ref.trainable_variables]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule,groups", [(Schedule1F1B, 4), (ScheduleInterleaved1F1B, 2)])
def test_tensor_parallel_stages_train_like_the_unpipelined_model(float64, schedule, groups):
    # stages on 2-device sub-meshes, each stage Megatron-style tensor parallel inside
    ref = whole(blocks())
    parts = blocks()
    stages = []
    for i, part in enumerate(parts):
        r = i % groups
        sub = DeviceMesh("cpu", [2 * r, 2 * r + 1], mesh_dim_names=("tp",))
        parallelize_module(part, sub, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        stages.append(PipelineStage(part, i, 4, sub))
    train_and_compare(ref, stages, schedule(stages, 4, loss_fn=mse), steps=10)


def test_stages_on_sub_meshes_of_different_sizes(float64):
    """2-way TP -> 4-way TP -> 2-way TP: activations move onto a larger mesh and gradients back, which TF
    DTensor's own copy to a larger mesh cannot do (docs/tf_dtensor_repros/copy_to_larger_mesh_hangs.py).
    One thread per rank, as by default (the 50-step stall runs below are in the slow suite)."""
    ref = whole(blocks(3))
    parts = blocks(3)
    stages = []
    for i, (part, devices) in enumerate(zip(parts, [[0, 1], [2, 3, 4, 5], [6, 7]])):
        sub = DeviceMesh("cpu", devices, mesh_dim_names=("tp",))
        parallelize_module(part, sub, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        stages.append(PipelineStage(part, i, 3, sub))
    train_and_compare(ref, stages, ScheduleGPipe(stages, 4, loss_fn=mse), steps=3)


PLACEMENTS = [[[0, 1], [2, 3, 4, 5], [6], "CPU:7"], [[0, 1], [2, 3], [4], "CPU:5"], [[0, 1], [2, 3, 4, 5], [6, 7]],
              [[0, 1], [2, 3], [4, 5], [6, 7]]]


def _placed_stages(placement, **kwargs):
    parts, stages = blocks(len(placement)), []
    for i, (part, where) in enumerate(zip(parts, placement)):
        if not isinstance(where, str):
            where = DeviceMesh("cpu", where, mesh_dim_names=("tp",))
            if where.size() > 1:
                parallelize_module(part, where, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        stages.append(PipelineStage(part, i, len(placement), where, **kwargs))
    return stages


@pytest.mark.parametrize("placement", PLACEMENTS,
                         ids=lambda p: "-".join(w if isinstance(w, str) else "".join(map(str, w)) for w in p))
@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_concurrent_steps_on_any_placement_never_stall(float64, placement, schedule):
    """Stages on sub-meshes of different sizes, 1-device meshes and device strings, one thread per rank:
    these stalled inside TF DTensor within 50 steps (up to 3 runs in 3, docs/design.md). 50 steps each,
    with a watchdog so a stall fails the test instead of hanging it; gradients equal the whole model's."""
    stages = _placed_stages(placement)
    pipe = schedule(stages, 4, loss_fn=mse)
    pipe.stall_timeout = 60.0
    for _ in range(50):
        for s in stages:
            s.zero_grads()
        pipe.step(X, target=Y)
    model = whole(blocks(len(placement)))
    with tf.GradientTape() as tape:
        loss = mse(model(X), Y)
    for a, b in zip([g for s in stages for g in s.grads], tape.gradient(loss, model.trainable_variables)):
        np.testing.assert_allclose(_value(a), b.numpy(), rtol=1e-12, atol=1e-14)


def _value(t):
    """A tensor's global value, from a sharded DTensor too."""
    from tensorflow.experimental import dtensor

    if dtensor.is_dtensor(t):
        t = dtensor.unpack(dtensor.relayout(t, dtensor.Layout.replicated(dtensor.fetch_layout(t).mesh, t.shape.rank)))[0]
    return t.numpy()


def test_a_stalled_step_raises_naming_the_ranks_and_actions(float64, monkeypatch):
    """The watchdog: a rank that stays inside an action past stall_timeout turns into an error that says
    what every rank was doing, instead of a step that never returns."""
    import threading
    import time

    from tfdist.pipelining import PipelineStallError

    stages = stages_for(ScheduleGPipe, blocks())
    pipe = ScheduleGPipe(stages, 4, loss_fn=mse)
    pipe.step(X, target=Y)  # compiled
    release = threading.Event()
    forward = stages[1].forward_one_chunk

    def stuck(microbatch, args, kwargs=None):
        release.wait(30)  # stands for a rank blocked inside TensorFlow
        return forward(microbatch, args, kwargs)

    monkeypatch.setattr(stages[1], "forward_one_chunk", stuck)
    pipe.stall_timeout = 1.0
    t0 = time.perf_counter()
    with pytest.raises(PipelineStallError) as err:
        pipe.step(X, target=Y)
    release.set()
    assert time.perf_counter() - t0 < 10
    message = str(err.value)
    assert "rank 1 running 1F0" in message and "rank 2 waiting for the inputs of 2F0" in message, message
    assert "stall_timeout=1" in message


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
                                      ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV])
def test_eval_is_forward_only(float64, schedule):
    """Every forward of the plan runs, those a plan pairs with a backward (DualPipeV's OVERLAP_F_B) too."""
    stages = stages_for(schedule, blocks())
    out = schedule(stages, 4).eval(X)
    np.testing.assert_allclose(out.numpy(), whole(blocks())(X).numpy(), rtol=1e-12)
    assert all(s.grads[0] is None for s in stages)
    assert all(not s._tapes for s in stages)  # no activations kept for a backward that never comes


def test_1f1b_plan_shows_the_run_and_keeps_torchs_exact_plan(float64):
    """torch's 1F1B plan numbers the last rank's forwards 1..n; pipeline_order shows what runs (each rank's
    actions, bubbles left out, are its executed order) and torch_pipeline_order is torch's fixture."""
    stages = stages_for(Schedule1F1B, blocks())
    pipe = Schedule1F1B(stages, 4, loss_fn=mse)
    pipe.step(X, target=Y)
    for r in range(4):
        assert [str(a) for a in pipe.pipeline_order[r] if a is not None] == [a for a, _, _ in pipe.executed_order[r]]
    case = next(c for c in CASES if c["schedule"] == "Schedule1F1B" and c["pp"] == 4 and c["n_microbatches"] == 4)
    torch_plan = {str(r): [None if a is None else str(a) for a in acts] for r, acts in pipe.torch_pipeline_order.items()}
    assert torch_plan == case["pipeline_order"]
    assert "3F4" in case["pipeline_order"]["3"] and "3F0" not in case["pipeline_order"]["3"]
    gpipe = ScheduleGPipe(stages_for(ScheduleGPipe, blocks()), 4, loss_fn=mse)
    assert gpipe.torch_pipeline_order == gpipe.pipeline_order
    # the run follows pipeline_order: its actions are 1F1B's loop (warm-up forwards, pairs, cool-down
    # backwards) for every size, written out independently in _orders.one_f_one_b_execution
    for p in range(2, 6):
        for m in range(p, p + 6):
            for r in range(p):
                assert ([a for a in _orders.one_f_one_b_plan_as_run(r, p, m) if a is not None]
                        == _orders.one_f_one_b_execution(r, p, m)), (p, m, r)


def test_executed_order_and_text_plan(float64):
    stages = stages_for(Schedule1F1B, blocks())
    pipe = Schedule1F1B(stages, 4, loss_fn=mse)
    pipe.step(X, target=Y)
    last = [a for a, _, _ in pipe.executed_order[3]]
    assert last == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3REDUCE_GRAD"]
    first = [a for a, _, _ in pipe.executed_order[0]]
    assert first[:4] == ["0F0", "0F1", "0F2", "0F3"]  # 3 warm-up forwards, then 1F1B
    table = str(pipe)
    assert table.splitlines()[0].split() == ["Step", "Rank", "0", "Rank", "1", "Rank", "2", "Rank", "3"]
    for acts in pipe.executed_order.values():  # each rank's actions ran one after the other
        assert all(end0 <= start1 for (_, _, end0), (_, start1, _) in zip(acts, acts[1:]))


def test_microbatch_split_and_merge():
    x, mask = np.arange(24.0).reshape(8, 3), np.ones((2, 8))
    args, kwargs = split_args_kwargs_into_chunks((x, mask, 7), {"m": x}, 4,
                                                 args_chunk_spec=(TensorChunkSpec(0), TensorChunkSpec(1), None))
    assert len(args) == 4 and args[1][0].shape == (2, 3) and args[1][1].shape == (2, 2) and args[1][2] == 7
    np.testing.assert_array_equal(merge_chunks([a[0] for a in args]).numpy(), x)
    np.testing.assert_array_equal(merge_chunks([a[1] for a in args], TensorChunkSpec(1)).numpy(), mask)
    assert kwargs[3]["m"].shape == (2, 3)
    with pytest.raises(ValueError, match="batch of 8 .* n_microbatches=3"):
        split_args_kwargs_into_chunks((x,), {}, 3)


def test_shape_mismatch_names_both_stages(float64):
    parts = blocks()
    stages = [PipelineStage(b, i, 4, f"CPU:{2 * i}",
                            output_args=tf.zeros((4, 5), tf.float64) if i == 1 else None)
              for i, b in enumerate(parts)]
    with pytest.raises(PipeliningShapeError, match=r"stage 1 outputs \[\(\[4, 8\], 'float64'\)\]"):
        ScheduleGPipe(stages, 4, loss_fn=mse).step(X, target=Y)


def test_bad_arguments_name_the_fix(float64):
    parts = blocks()
    stages = stages_for(Schedule1F1B, parts)
    with pytest.raises(ValueError, match="n_microbatches=2: 1F1B needs at least as many microbatches as stages"):
        Schedule1F1B(stages, 2, loss_fn=mse)
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        ScheduleGPipe(stages, 0, loss_fn=mse)
    with pytest.raises(ValueError, match="needs loss_fn"):
        ScheduleGPipe(stages, 4).step(X, target=Y)
    with pytest.raises(ValueError, match="every stage of the pipeline"):
        ScheduleGPipe(stages[:3], 4, loss_fn=mse)
    overlapping = [PipelineStage(b, i, 4, "CPU:0" if i < 2 else f"CPU:{i}") for i, b in enumerate(parts)]
    with pytest.raises(ValueError, match="stages on overlapping devices"):
        ScheduleGPipe(overlapping, 4, loss_fn=mse)
    with pytest.raises(ValueError, match="stage_index must be in"):
        PipelineStage(parts[0], 4, 4, "CPU:0")
    with pytest.raises(TypeError, match="device must be"):
        PipelineStage(parts[0], 0, 4, 3)
    with pytest.raises(ValueError, match="ZBVZeroBubble needs exactly 2 stages per pipeline rank"):
        ScheduleZBVZeroBubble(stages, 4, loss_fn=mse)
    with pytest.raises(ValueError, match="n_microbatches=2: DualPipeV needs at least as many"):
        ScheduleDualPipeV(stages_for(ScheduleDualPipeV, parts), 2, loss_fn=mse)
    with pytest.raises(ValueError, match="multiple of"):
        ScheduleInterleaved1F1B(stages_for(ScheduleInterleaved1F1B, parts), 5, loss_fn=mse)  # 2 rounds of 2.5


@pytest.mark.parametrize("m", [4, 8, 16])
def test_plan_bubble_matches_the_gpipe_formula_and_zero_bubble_is_lower(m):
    from tfdist.pipelining import _timeline

    p = 4
    theory = (p - 1) / (m + p - 1)  # with backward = 2 forwards
    for plan in ({r: _orders.gpipe(r, p, m) for r in range(p)},
                 {r: _orders.one_f_one_b_execution(r, p, m) for r in range(p)}):
        assert _timeline.bubble_fraction(_timeline.simulate(plan, p)) == pytest.approx(theory)
    zero = _timeline.bubble_fraction(_timeline.simulate(_orders.interleaved_zero_bubble(p, 2, m), 2 * p))
    assert zero < theory / 2


def test_a_plan_timed_with_per_stage_costs_waits_for_its_slowest_stage():
    """GPipe, 2 stages, 2 microbatches; stage 1's forward costs 3, backwards 2 (by hand: rank 0 runs
    F0 0-1, F1 1-2; rank 1 F0 1-4, F1 4-7, B0 7-9, B1 9-11; rank 0 B0 9-11, B1 11-13)."""
    from tfdist.pipelining import _timeline
    from tfdist.pipelining._actions import B, F

    plan = {r: _orders.gpipe(r, 2, 2) for r in range(2)}
    got = _timeline.simulate(plan, 2, {F: 1.0, B: 2.0, (1, F): 3.0})
    assert got[1][:4] == [("1F0", 1.0, 4.0), ("1F1", 4.0, 7.0), ("1B0", 7.0, 9.0), ("1B1", 9.0, 11.0)]
    assert got[0][:4] == [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 9.0, 11.0), ("0B1", 11.0, 13.0)]
    assert _timeline.bubble_fraction(got) == pytest.approx(1 - (6 + 10) / (2 * 13))


def test_1f1b_holds_fewer_microbatch_inputs_than_gpipe(float64):
    held = {}
    for schedule in (ScheduleGPipe, Schedule1F1B):
        stages = stages_for(schedule, blocks())
        schedule(stages, 8, loss_fn=mse).step(X, target=Y)
        held[schedule] = [s.peak_held_inputs for s in stages]
    assert held[ScheduleGPipe] == [8, 8, 8, 8]
    assert held[Schedule1F1B] == [4, 3, 2, 1]  # num_stages - stage_index


def test_one_action_at_a_time_gives_the_same_step(float64):
    grads = {}
    for concurrent in (True, False):
        stages = stages_for(ScheduleInterleavedZeroBubble, blocks())
        pipe = ScheduleInterleavedZeroBubble(stages, 4, loss_fn=mse)
        pipe.concurrent = concurrent
        pipe.step(X, target=Y)
        grads[concurrent] = [g.numpy() for s in stages for g in s.grads]
        ranks = [[a for a, _, _ in pipe.executed_order[r]] for r in (0, 1)]
        planned = [[str(a) for a in pipe.pipeline_order[r] if a is not None] for r in (0, 1)]
        assert ranks == planned  # each rank ran its plan in order
    for a, b in zip(grads[True], grads[False]):
        np.testing.assert_array_equal(a, b)


def sequential_of_8(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,))] + [
        keras.layers.Dense(8, activation="tanh" if i < 7 else None, name=f"d{i}") for i in range(8)])


def test_pipeline_splits_a_sequential_model_and_keeps_its_weights(float64):
    from tfdist.pipelining import SplitPoint, pipeline

    model = sequential_of_8()
    with tf.GradientTape() as tape:
        loss = mse(model(X), Y)
    want = tape.gradient(loss, model.trainable_variables)
    pipe = pipeline(model, (X[:4],), split_spec={"d2": SplitPoint.BEGINNING, "layers.3": SplitPoint.END,
                                                 "d5": SplitPoint.END})
    assert pipe.num_stages == 4
    assert [[l.name for l in pipe.get_stage_module(i).layers] for i in range(4)] == [
        ["d0", "d1"], ["d2", "d3"], ["d4", "d5"], ["d6", "d7"]]
    assert pipe.get_stage_module(1).layers[0].kernel is model.layers[2].kernel  # the same weights
    assert [list(s.shape) for s in pipe.info().stage_outputs[0]] == [[4, 8]]
    stages = [pipe.build_stage(i, f"CPU:{2 * i}") for i in range(4)]
    ScheduleGPipe(stages, 4, loss_fn=mse).step(X, target=Y)
    for a, b in zip([g for s in stages for g in s.grads], want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)


def test_pipe_split_markers_and_functional_chains(float64):
    from tfdist.pipelining import pipe_split, pipeline

    keras.utils.set_random_seed(0)
    a, b, c = (keras.layers.Dense(8, name=n) for n in "abc")
    model = keras.Sequential([keras.Input((8,)), a, pipe_split(), b, pipe_split(), c])
    np.testing.assert_allclose(model(X).numpy(), c(b(a(X))).numpy())  # the markers are the identity
    assert pipeline(model, (X[:4],)).num_stages == 3
    a, b, c = (keras.layers.Dense(8, name=n) for n in "abc")  # fresh: a functional model records its calls
    inputs = keras.Input((8,))
    functional = keras.Model(inputs, c(b(a(inputs))))
    assert pipeline(functional, (X[:4],), split_policy=lambda layers: [1]).num_stages == 2


def test_pipeline_bad_split_points(float64):
    from tfdist.pipelining import SplitPoint, pipeline

    model = sequential_of_8()
    with pytest.raises(ValueError, match="'nope' names no layer of the model"):
        pipeline(model, (X[:4],), split_spec={"nope": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match="single stage"):
        pipeline(model, (X[:4],), split_spec={"d0": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match="single stage"):
        pipeline(Identity(), (X[:4],))  # a call with nothing to cut


class Identity(keras.Model):
    def call(self, x):
        return x


def test_pp_dp_tp_2x2x2_trains_like_the_unpipelined_model(float64):
    from tfdist.fsdp import fully_shard

    ref = whole(blocks(2))
    stages = []
    for i, part in enumerate(blocks(2)):  # each stage on a (dp, tp) = 2 x 2 sub-mesh: FSDP over TP inside
        sub = DeviceMesh("cpu", [[4 * i, 4 * i + 1], [4 * i + 2, 4 * i + 3]], mesh_dim_names=("dp", "tp"))
        parallelize_module(part, sub["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(part, mesh=sub["dp"])
        stages.append(PipelineStage(part, i, 2, sub))
    train_and_compare(ref, stages, Schedule1F1B(stages, 4, loss_fn=mse), steps=5)


def test_plot_and_timeline(tmp_path, float64):
    from tfdist.pipelining import plot_schedule, timeline

    stages = stages_for(Schedule1F1B, blocks())
    pipe = Schedule1F1B(stages, 4, loss_fn=mse)
    planned = timeline(pipe)
    assert [a for a, _, _ in planned[3]][:2] == ["3F0", "3B0"]
    assert max(e for acts in planned.values() for _, _, e in acts) == (4 + 4 - 1) * 3  # (m + p - 1) x (F + B)
    with pytest.raises(ValueError, match="run schedule.step"):
        timeline(pipe, executed=True)
    pipe.step(X, target=Y)
    for executed in (False, True):
        path = plot_schedule(pipe, tmp_path / f"plan-{executed}.png", executed=executed)
        assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plan_of_your_own(float64):
    from tfdist.pipelining import PipelineScheduleMulti

    _, want = reference_grads()
    stages = stages_for(ScheduleLoopedBFS, blocks())
    with pytest.warns(FutureWarning, match="use_full_backward"):  # torch's: accepted, no longer used
        PipelineScheduleMulti(stages, 2, loss_fn=mse, use_full_backward=True)
    # torch's LoopedBFS takes no chunk specs: a fourth positional argument is the merge spec
    merge = TensorChunkSpec(0)
    assert ScheduleLoopedBFS(stages, 2, mse, merge)._output_merge_spec is merge
    pipe = PipelineScheduleMulti(stages, 2, loss_fn=mse)
    with pytest.raises(ValueError, match="cannot proceed"):  # backward of stage 2 before stage 3's
        pipe.load_pipeline_order({0: ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
                                  1: ["1F0", "1F1", "3F0", "3F1", "1B0", "1B1", "3B0", "3B1"]})
    with pytest.raises(ValueError, match="needs a forward and a backward"):
        pipe.load_pipeline_order({0: ["0F0", "0F1"], 1: ["1F0"]})
    pipe.load_pipeline_order({0: ["0F0", "0F1", "2F0", "2F1", None, "2B0", "2B1", "0B0", "0B1"],
                              1: ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"]})
    pipe.step(X, target=Y)
    for a, b in zip([g for s in stages for g in s.grads], want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14)
