"""Pipeline schedules (torch.distributed.pipelining.schedules).

A schedule's plan is data: ``pipeline_order[rank]`` lists that pipeline
rank's actions per time step (``None`` idle), in torch's ``_Action`` string
form, equal to torch's plan for the same schedule, pipeline size, stages per
rank and microbatch count.  ``step()`` runs the plan over the stages this
process holds: every rank's queue in its order, an action starting once what
it needs exists (the previous stage's output for a forward, the next stage's
input gradient for a backward).  ``executed_order`` records what ran, per
rank, with start and end times.

One process holds every stage of a pipeline here (all ranks of the plan);
stages of different ranks live on different devices or sub-meshes.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import tensorflow as tf

from tfdist.pipelining import _orders
from tfdist.pipelining import _timeline
from tfdist.pipelining._actions import B, F, I, OVERLAP_F_B, REDUCE_GRAD, W, Action, format_pipeline_order
from tfdist.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from tfdist.pipelining.stage import PipelineStage

__all__ = [
    "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
    "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
    return value


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class _PipelineSchedule:
    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable | None,
                 args_chunk_spec: tuple | None, kwargs_chunk_spec: dict | None, output_merge_spec: Any,
                 scale_grads: bool) -> None:
        self._n_microbatches = _positive_int("n_microbatches", n_microbatches)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, target) -> loss. Received: {loss_fn!r}")
        for s in stages:
            if not isinstance(s, PipelineStage):
                raise TypeError(f"stages must be PipelineStage objects. Received: {type(s).__name__}")
        self._loss_fn = loss_fn
        self._args_chunk_spec, self._kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        self.concurrent = True  # one thread per pipeline rank; False: one action at a time (debugging)
        self._num_stages = self._stages[0].num_stages
        self.executed_order: dict[int, list[tuple[str, float, float]]] = {}

    # -- the plan ----------------------------------------------------------------------------------
    def _rank_of(self, stage_index: int) -> int:
        raise NotImplementedError

    def _execution_order(self) -> dict[int, list[Action | None]]:
        return self.pipeline_order

    def __str__(self) -> str:
        return format_pipeline_order(self.pipeline_order)

    def _check_stages(self) -> None:
        indices = [s.stage_index for s in self._stages]
        if sorted(indices) != list(range(self._num_stages)):
            raise ValueError(
                f"stages: this process must hold every stage of the pipeline (0..{self._num_stages - 1}); "
                f"received stages {indices}."
            )
        if any(s.num_stages != self._num_stages for s in self._stages):
            raise ValueError("stages: every stage must be built with the same num_stages.")
        owner: dict[str, int] = {}
        for s in self._stages:
            rank = self._rank_of(s.stage_index)
            for device in s.device_key.split(":", 1)[1].split(","):
                if owner.setdefault(device, rank) != rank:
                    raise ValueError(
                        f"stages on overlapping devices: stage {s.stage_index} (pipeline rank {rank}) uses {device}, "
                        f"which pipeline rank {owner[device]} uses too. Give each pipeline rank its own devices."
                    )

    # -- running -------------------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """One training iteration on a whole batch: split into microbatches, run the plan, leave the
        gradients in each stage's ``grads``; returns the last stage's merged output.

        Example::

            schedule.step(x, target=y, losses=losses)
            optimizer.apply(stage.grads, stage.submod.trainable_variables)
        """
        if self._loss_fn is None:
            raise ValueError("step() trains and needs loss_fn=(output, target) -> loss on the schedule; "
                             "for forward only, call eval().")
        if target is None:
            raise ValueError("step(): pass target=... for the last stage's loss_fn.")
        self._run(args, kwargs, target, backward=True)
        if losses is not None:
            last = self._stages[-1]
            losses.extend(last.losses[m] for m in range(self._n_microbatches))
        return self._merged_output()

    def _merged_output(self) -> Any:
        chunks = [out for _, out in sorted(self._stages[-1].output_chunks, key=lambda c: c[0])]
        return merge_chunks(chunks, self._output_merge_spec)

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, every microbatch in the plan's forward order; returns the merged output."""
        self._run(args, kwargs, None, backward=False)
        return self._merged_output()

    def _run(self, args: tuple, kwargs: dict, target: Any, backward: bool) -> None:
        n = self._n_microbatches
        args_split, kwargs_split = split_args_kwargs_into_chunks(
            args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec)
        if kwargs_split and kwargs_split[0]:
            raise ValueError("step(): keyword inputs are not supported by tfdist stages; pass tensors positionally.")
        targets = split_args_kwargs_into_chunks((target,), {}, n)[0] if target is not None else None
        for s in self._stages:
            s.clear_runtime_states()
        order = self._execution_order()
        queues = {r: [a for a in acts if a is not None and (backward or a.computation_type == F)]
                  for r, acts in order.items()}
        done: set[tuple[int, str, int | None]] = set()
        self.executed_order = {r: [] for r in queues}
        if self.concurrent:
            self._run_concurrently(queues, args_split, targets, done)
        else:
            self._run_in_turn(queues, args_split, targets, done)
        if backward:  # plans without REDUCE_GRAD steps (the multi-stage ones) reduce at the end, as torch
            for s in self._stages:
                if (s.stage_index, "reduced", None) not in done:
                    s.scale_grads(n if self.scale_grads else 1)

    def _run_in_turn(self, queues: dict, args_split: list, targets: list | None, done: set) -> None:
        """One action at a time, cycling over the ranks (for debugging: ``concurrent = False``)."""
        start = time.perf_counter()
        while any(queues.values()):
            progressed = False
            for rank in sorted(queues):
                queue = queues[rank]
                if queue and self._ready(queue[0], done):
                    action = queue.pop(0)
                    t0 = time.perf_counter() - start
                    done |= self._do_annotated(rank, action, args_split, targets)
                    self.executed_order[rank].append((str(action), t0, time.perf_counter() - start))
                    progressed = True
            if not progressed:
                heads = {r: str(q[0]) for r, q in queues.items() if q}
                raise RuntimeError(f"pipeline plan cannot proceed: waiting actions {heads}")

    def _run_concurrently(self, queues: dict, args_split: list, targets: list | None, done: set) -> None:
        """One thread per pipeline rank, as torch has one process per rank: TensorFlow releases the
        GIL while a stage's compiled program runs, so stages on different devices overlap."""
        cond = threading.Condition()
        failures: list[BaseException] = []
        start = time.perf_counter()

        def rank_loop(rank: int, queue: list) -> None:
            for action in queue:
                with cond:
                    while not failures and not self._ready(action, done):
                        if not cond.wait(timeout=600):
                            failures.append(RuntimeError(f"pipeline rank {rank} waited 600 s for {action}"))
                    if failures:
                        return
                t0 = time.perf_counter() - start
                try:
                    made = self._do_annotated(rank, action, args_split, targets)
                except BaseException as e:  # noqa: BLE001 - re-raised by step() below
                    with cond:
                        failures.append(e)
                        cond.notify_all()
                    return
                with cond:
                    done.update(made)
                    self.executed_order[rank].append((str(action), t0, time.perf_counter() - start))
                    cond.notify_all()

        threads = [threading.Thread(target=rank_loop, args=(r, q), name=f"tfdist-pipeline-rank-{r}")
                   for r, q in sorted(queues.items())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]

    def _ready(self, a: Action, done: set) -> bool:
        if a.computation_type == OVERLAP_F_B:
            return all(self._ready(sub, done) for sub in a.sub_actions)
        s, kind, m = a.stage_index, a.computation_type, a.microbatch_index
        if kind == F:
            return s == 0 or (s - 1, "F", m) in done
        if kind in (B, I):
            return (s, "F", m) in done and (s == self._num_stages - 1 or (s + 1, "dx", m) in done)
        if kind == W:
            return (s, "I", m) in done
        if kind == REDUCE_GRAD:
            return all((s, "w", k) in done for k in range(self._n_microbatches))
        return True

    def _do_annotated(self, rank: int, a: Action, args_split: list, targets: list | None) -> set:
        """``_do`` inside a profiler annotation named by the action (free when no profiler runs), so a TF
        profiler trace shows each rank's actions on its thread beside the kernels they launched."""
        with tf.profiler.experimental.Trace(str(a), pipeline_rank=rank, pipeline_stage=a.stage_index):
            return self._do(a, args_split, targets)

    def _do(self, a: Action, args_split: list, targets: list | None) -> set:
        if a.computation_type == OVERLAP_F_B:  # a forward and a backward back to back
            return set().union(*(self._do(sub, args_split, targets) for sub in a.sub_actions))
        s, kind, m = a.stage_index, a.computation_type, a.microbatch_index
        stage = self._stages[s]
        if kind == F:
            inputs = args_split[m] if s == 0 else _as_tuple(self._stages[s - 1].outputs[m])
            out = stage.forward_one_chunk(m, tuple(inputs))
            if stage.is_last:
                stage.output_chunks.append((m, out))
                if targets is not None:
                    stage.compute_loss(m, self._loss_fn, targets[m][0])
            return {(s, "F", m)}
        if kind == REDUCE_GRAD:
            stage.scale_grads(self._n_microbatches if self.scale_grads else 1)
            return {(s, "reduced", None)}
        if kind in (B, I) and not stage.is_last:
            # the next stage's input gradients, one per tensor this stage passed it
            dx = tuple(stage.place(g) for g in self._stages[s + 1].input_grads[m])
            stage.output_grads[m] = dx if isinstance(stage.outputs[m], (tuple, list)) else dx[0]
        loss_fn = self._loss_fn if stage.is_last else None
        stage.backward_one_chunk(m, loss_fn, inputs=kind in (B, I), weights=kind in (B, W))
        made = set()
        if kind in (B, I):
            made |= {(s, "I", m), (s, "dx", m)}
        if kind in (B, W):
            made.add((s, "w", m))
        return made


class PipelineScheduleSingle(_PipelineSchedule):
    """Schedules with one stage per pipeline rank.  Pass the stage, or (one process holding the whole
    pipeline) the list of all stages."""

    def __init__(self, stage: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        self.pp_group_size = self._num_stages
        self._check_stages()
        self.pipeline_order = {r: self._plan(r) for r in range(self.pp_group_size)}

    def _rank_of(self, stage_index: int) -> int:
        return stage_index

    def _plan(self, rank: int) -> list[Action | None]:
        raise NotImplementedError


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: every microbatch's forward, then every backward.

    Example::

        stages = [PipelineStage(block, i, 4, f"CPU:{2 * i}") for i, block in enumerate(blocks)]
        schedule = ScheduleGPipe(stages, n_microbatches=8, loss_fn=mse)
        schedule.step(x, target=y)
    """

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.gpipe(rank, self.pp_group_size, self._n_microbatches)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: after a warm-up, each rank alternates one forward and one backward, so at most
    ``num_stages - rank`` microbatch inputs are held per stage (GPipe holds all of them).

    ``pipeline_order`` is torch's plan, identical to it; torch 2.13's plan numbers the last rank's
    forwards 1..n (see ``tfdist.pipelining._orders.one_f_one_b_plan``), the run uses 0..n-1.
    """

    def __init__(self, stage: Any, n_microbatches: int, *args: Any, **kwargs: Any) -> None:
        num = (stage[0] if isinstance(stage, (list, tuple)) else stage).num_stages
        if isinstance(n_microbatches, int) and n_microbatches < num:
            raise ValueError(
                f"n_microbatches={n_microbatches}: 1F1B needs at least as many microbatches as stages ({num}); "
                f"use ScheduleGPipe or n_microbatches >= {num}."
            )
        super().__init__(stage, n_microbatches, *args, **kwargs)

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.one_f_one_b_plan(rank, self.pp_group_size, self._n_microbatches)

    def _execution_order(self) -> dict[int, list[Action | None]]:
        return {r: _orders.one_f_one_b_execution(r, self.pp_group_size, self._n_microbatches)
                for r in range(self.pp_group_size)}


class PipelineScheduleMulti(_PipelineSchedule):
    """Schedules with several stages per pipeline rank: rank ``r`` holds stages ``r, r + pp, ...``;
    ``pp`` is the number of distinct device groups among the stages."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        if not isinstance(stages, (list, tuple)) or not stages:
            raise TypeError(f"stages must be a non-empty list of PipelineStage. Received: {stages!r}")
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        groups = {s.device_key for s in self._stages}
        if self._num_stages % len(groups):
            raise ValueError(
                f"stages: {self._num_stages} stages on {len(groups)} device groups; every pipeline rank needs the "
                "same number of stages."
            )
        self.pp_group_size = len(groups)
        self.n_local_stages = self._num_stages // self.pp_group_size
        for s in self._stages:  # a rank's stages share its device group (rank r holds stage r)
            same = self._stages[self._rank_of(s.stage_index)].device_key
            if s.device_key != same:
                raise ValueError(
                    f"stages: stage {s.stage_index} belongs to pipeline rank {self._rank_of(s.stage_index)}, "
                    f"whose stages share its devices, but is on other devices."
                )
        self._check_stages()
        self.pipeline_order = {r: self._plan(r) for r in range(self.pp_group_size)}

    def _rank_of(self, stage_index: int) -> int:
        return stage_index % self.pp_group_size

    def _plan(self, rank: int) -> list[Action | None]:
        return self._custom_order.get(rank, []) if hasattr(self, "_custom_order") else []

    def load_pipeline_order(self, order: dict[int, Sequence[Action | str | None]]) -> None:
        """Runs a plan of your own (torch's custom schedules): ``{rank: [action or "0F1" or None, ...]}``,
        each rank's actions on its own stages.  The plan is checked for completeness and for deadlock
        before it is accepted.

        Example::

            schedule = PipelineScheduleMulti(stages, 2, loss_fn=mse)
            schedule.load_pipeline_order({0: ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
                                          1: ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"]})
        """
        parsed: dict[int, list[Action | None]] = {}
        for rank, actions in order.items():
            if rank not in range(self.pp_group_size):
                raise ValueError(f"order: rank {rank!r} is not a pipeline rank (0..{self.pp_group_size - 1}).")
            parsed[rank] = [a if a is None or isinstance(a, Action) else Action.from_str(a) for a in actions]
            for a in parsed[rank]:
                if a is not None and a.computation_type != OVERLAP_F_B and self._rank_of(a.stage_index) != rank:
                    raise ValueError(f"order: rank {rank} lists {a}, but stage {a.stage_index} is on rank "
                                     f"{self._rank_of(a.stage_index)}.")
        done = {(a.stage_index, a.computation_type, a.microbatch_index)
                for acts in parsed.values() for a in acts if a is not None}
        for s in range(self._num_stages):
            for m in range(self._n_microbatches):
                if (s, F, m) not in done or not ({(s, B, m), (s, I, m)} & done):
                    raise ValueError(f"order: stage {s} microbatch {m} needs a forward and a backward.")
        try:
            _timeline.simulate(parsed, self._num_stages)
        except RuntimeError as e:
            raise ValueError(f"order: {e} (each waits for another)") from None
        self._custom_order = parsed
        self.pipeline_order = parsed


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B (Megatron's virtual stages): depth first over each rank's stages.

    Example::

        # 2 pipeline ranks, 2 stages each: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
        stages = [PipelineStage(blocks[i], i, 4, mesh_of_rank[i % 2]) for i in range(4)]
        ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=mse).step(x, target=y)
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, *args: Any, **kwargs: Any) -> None:
        if isinstance(n_microbatches, int) and n_microbatches > 0:
            groups = len({s.device_key for s in stages}) if isinstance(stages, (list, tuple)) else 1
            _orders.interleaved_rounds(max(groups, 1), n_microbatches)
        super().__init__(stages, n_microbatches, *args, **kwargs)

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.interleaved_1f1b(rank, self.pp_group_size, self.n_local_stages, self._n_microbatches)


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Looped breadth-first: every microbatch through a rank's earlier stage before its later one."""

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.looped_bfs(rank, self.pp_group_size, self.n_local_stages, self._n_microbatches)


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved zero bubble: the interleaved plan with each backward split into its input part
    (``I``) and weight part (``W``), the weight parts filling what would be idle steps."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, *args: Any, **kwargs: Any) -> None:
        if isinstance(n_microbatches, int) and n_microbatches > 0 and isinstance(stages, (list, tuple)):
            _orders.interleaved_rounds(max(len({s.device_key for s in stages}), 1), n_microbatches)
        super().__init__(stages, n_microbatches, *args, **kwargs)

    def _plan(self, rank: int) -> list[Action | None]:
        if not hasattr(self, "_plans"):
            self._plans = _orders.interleaved_zero_bubble(self.pp_group_size, self.n_local_stages,
                                                          self._n_microbatches)
        return self._plans[rank]


class _VShaped(PipelineScheduleMulti):
    """2 stages per rank, rank ``r`` holding stages ``r`` and ``2 pp - 1 - r`` (so the first and last
    stages share a rank's devices)."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, *args: Any, **kwargs: Any) -> None:
        if isinstance(stages, (list, tuple)) and stages and isinstance(stages[0], PipelineStage):
            groups = len({s.device_key for s in stages})
            if len(stages) != 2 * groups:
                raise ValueError(
                    f"stages: {type(self).__name__.removeprefix('Schedule')} needs exactly 2 stages per pipeline "
                    f"rank; received {len(stages)} stages on {groups} device groups."
                )
        super().__init__(stages, n_microbatches, *args, **kwargs)

    def _rank_of(self, stage_index: int) -> int:
        pp = self.pp_group_size
        return stage_index if stage_index < pp else 2 * pp - 1 - stage_index


class ScheduleZBVZeroBubble(_VShaped):
    """The V-shaped zero-bubble schedule (backward split into ``I`` and ``W``)."""

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.zbv(rank, self.pp_group_size, self._n_microbatches)


class ScheduleDualPipeV(_VShaped):
    """DeepSeek's DualPipeV (torch's newest schedule): V-shaped, with a forward of one stage and a
    backward of the other paired in one ``OVERLAP_F_B`` action during the steady phase."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, *args: Any, **kwargs: Any) -> None:
        num = stages[0].num_stages if isinstance(stages, (list, tuple)) and stages else 0
        if isinstance(n_microbatches, int) and n_microbatches < num:
            raise ValueError(
                f"n_microbatches={n_microbatches}: DualPipeV needs at least as many microbatches as stages "
                f"({num})."
            )
        super().__init__(stages, n_microbatches, *args, **kwargs)

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.dualpipe_v(rank, self.pp_group_size, self._n_microbatches)

