"""Pipeline schedules (torch.distributed.pipelining.schedules).

A schedule's plan is data: ``pipeline_order[rank]`` lists that pipeline
rank's actions per time step (``None`` idle), in torch's ``_Action`` string
form, equal to torch's plan for the same schedule, pipeline size, stages per
rank and microbatch count.  ``step()`` runs the plan over the stages this
process holds: every rank's queue in its order, an action starting once what
it needs exists (the previous stage's output for a forward, the next stage's
input gradient for a backward).  ``executed_order`` records what ran, per
rank, with start and end times.

One process may hold every stage of a pipeline (all ranks of the plan, on
different devices or sub-meshes), or each client of a multi-client job holds
its own stages, as each torch rank does: the clients learn where every stage
lives through the coordination service, and each boundary between clients
becomes two ``tfdist.pipelining._p2p.Channel`` s (activations forward,
gradients backward) served by their own threads.  There the first stage's
client passes the inputs to ``step()``, the last stage's client the target,
and the others call ``step()`` with neither.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfdist import _runtime
from tfdist._client_kv import Group
from tfdist.pipelining import _orders
from tfdist.pipelining import _timeline
from tfdist.pipelining._actions import B, F, I, OVERLAP_F_B, REDUCE_GRAD, W, Action, format_pipeline_order
from tfdist.device_mesh import DeviceMesh
from tfdist.pipelining._p2p import Channel, channel_index, from_wire, to_wire
from tfdist.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from tfdist.pipelining.stage import _EAGER_LOCK, PipelineStage

__all__ = [
    "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
    "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV", "PipelineStallError",
]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
    return value


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _flat(actions: Sequence[Action | None]) -> list[Action]:
    """The computations of a rank's order, an ``OVERLAP_F_B`` pair as its two parts."""
    out: list[Action] = []
    for a in actions:
        if a is not None:
            out += list(a.sub_actions) if a.computation_type == OVERLAP_F_B else [a]
    return out


class PipelineStallError(RuntimeError):
    """A concurrent pipeline step made no progress for ``schedule.stall_timeout`` seconds."""


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where a stage lives: each of its clients with that client's devices of it (full names), and its
    sub-mesh as (dim names, shape, every device in mesh order), None for a stage on one device."""

    by_client: tuple[tuple[int, tuple[str, ...]], ...]
    mesh: tuple | None = None

    @property
    def clients(self) -> tuple[int, ...]:
        return tuple(c for c, _ in self.by_client)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for _, devices in self.by_client for d in devices)

    def devices_of(self, client: int) -> tuple[str, ...]:
        return dict(self.by_client)[client]

    @property
    def device_key(self) -> str:
        return ",".join(self.devices)

    def coordinates_of(self, client: int) -> list[tuple[int, ...]]:
        """The sub-mesh coordinates of ``client``'s devices, sorted."""
        _, shape, devices = self.mesh
        return sorted(tuple(int(c) for c in np.unravel_index(list(devices).index(d), shape))
                      for d in self.devices_of(client))


def _mesh_spec(stage: PipelineStage) -> tuple | None:
    """A stage's sub-mesh as (dim names, shape, the full names of every device, all clients', in mesh
    order), or None for a stage on one device."""
    if not isinstance(stage.device, DeviceMesh):
        return None
    tf_mesh = stage.device.to_tf()
    return (list(tf_mesh.dim_names), list(tf_mesh.shape()), list(tf_mesh.global_devices() or tf_mesh.local_devices()))


def _congruent(a: _Place, ca: int, b: _Place, cb: int) -> bool:
    """Whether client ``ca`` of stage place ``a`` and client ``cb`` of ``b`` hold the same coordinates of
    sub-meshes of one shape and dim names: a tensor laid out on one then crosses shard by shard."""
    return (a.mesh is not None and b.mesh is not None and list(a.mesh[:2]) == list(b.mesh[:2])
            and a.coordinates_of(ca) == b.coordinates_of(cb))


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
        if not stages:
            raise ValueError("stages: pass this client's PipelineStage objects (at least one).")
        self.concurrent = True  # one thread per pipeline rank; False: one action at a time (debugging)
        self.p2p_timeout = 600.0  # seconds a transfer between clients may wait for the other side
        # seconds a concurrent step may go without any action finishing before step() raises a
        # PipelineStallError naming what each rank was doing (None: wait forever)
        self.stall_timeout: float | None = 600.0
        self._num_stages = stages[0].num_stages
        self._local: dict[int, PipelineStage] = {}
        for st in stages:
            if st.stage_index in self._local:
                raise ValueError(f"stages: stage {st.stage_index} is given twice.")
            self._local[st.stage_index] = st
        self._client = _runtime.get_rank() if _runtime.is_multi_client() else 0
        self._places = self._discover()
        self._received: dict[tuple[int, str, int], tuple] = {}
        self._outgoing: dict[tuple[int, str, int], tuple] = {}  # made by a rank, sent by a channel
        self._channels: list[tuple[Channel, str, int]] | None = None
        self.executed_order: dict[int, list[tuple[str, float, float]]] = {}

    # -- the plan ----------------------------------------------------------------------------------
    def _rank_of(self, stage_index: int) -> int:
        raise NotImplementedError

    def _execution_order(self) -> dict[int, list[Action | None]]:
        return self.pipeline_order

    @property
    def torch_pipeline_order(self) -> dict[int, list[Action | None]]:
        """torch's ``pipeline_order`` for this schedule, for comparison: the same as ``pipeline_order``
        except for 1F1B, whose torch plan numbers the last rank's forwards 1..n."""
        return self.pipeline_order

    def __str__(self) -> str:
        return format_pipeline_order(self.pipeline_order)

    def _discover(self) -> dict[int, _Place]:
        """Every stage's client and devices: this client's, or (multi-client) every client's, gathered
        through the coordination service."""
        mine = [(i, st.num_stages, st.devices, _mesh_spec(st)) for i, st in sorted(self._local.items())]
        if _runtime.is_multi_client():
            gathered = Group(no_dist=False, timeout=self.p2p_timeout, namespace="pipelining").all_gather(mine)
        else:
            gathered = [mine]
        by_stage: dict[int, list[tuple[int, tuple[str, ...]]]] = {}
        meshes: dict[int, list] = {}
        for client, items in enumerate(gathered):
            for index, num, devices, mesh in items:
                if num != self._num_stages:
                    raise ValueError("stages: every stage must be built with the same num_stages; "
                                     f"stage {index} on client {client} has {num}, not {self._num_stages}.")
                # a stage on a sub-mesh spanning clients is built by each of them, with its own devices
                by_stage.setdefault(index, []).append((client, tuple(devices)))
                meshes.setdefault(index, []).append(mesh)
        for index, held in by_stage.items():
            clients = [c for c, _ in held]
            spanned = {tf.DeviceSpec.from_string(d).task for d in (meshes[index][0] or ((), (), ()))[2]}
            if len(held) > 1 and (any(m != meshes[index][0] for m in meshes[index]) or set(clients) != spanned):
                raise ValueError(
                    f"stages: stage {index} is held by clients {clients[0]} and {clients[1]}; a stage belongs to "
                    "one client, or to the clients of the one sub-mesh (DeviceMesh) it is built on, each of "
                    "them building it."
                )
        return {index: _Place(tuple(held), meshes[index][0]) for index, held in by_stage.items()}

    def _check_stages(self) -> None:
        indices = sorted(self._places)
        if indices != list(range(self._num_stages)):
            who = "the clients together" if _runtime.is_multi_client() else "this process"
            raise ValueError(
                f"stages: {who} must hold every stage of the pipeline (0..{self._num_stages - 1}); "
                f"received stages {indices}."
            )
        owner: dict[str, int] = {}
        for index, place in sorted(self._places.items()):
            rank = self._rank_of(index)
            for device in place.devices:
                if owner.setdefault(device, rank) != rank:
                    raise ValueError(
                        f"stages on overlapping devices: stage {index} (pipeline rank {rank}) uses {device}, "
                        f"which pipeline rank {owner[device]} uses too. Give each pipeline rank its own devices."
                    )
        self._check_spanning_stages()

    def _check_spanning_stages(self) -> None:
        """Stages on sub-meshes spanning clients: neighbours pair their clients one to one, and each such
        client runs one pipeline rank (its clients then issue the rank's TF DTensor ops in one order,
        which TF's collectives between them need)."""
        if all(len(p.clients) == 1 for p in self._places.values()):
            return
        for s in range(self._num_stages - 1):
            a, b = self._places[s].clients, self._places[s + 1].clients
            if a != b and (len(a) != len(b) or set(a) & set(b)):
                raise ValueError(
                    f"stages {s} and {s + 1} are on clients {list(a)} and {list(b)}: neighbouring stages on "
                    "sub-meshes spanning clients must be on the same clients or on as many other clients "
                    "(the i-th client of one sends to the i-th of the other, as torch pairs ranks)."
                )
        ranks: dict[int, set[int]] = {}
        for index, place in self._places.items():
            for client in place.clients:
                ranks.setdefault(client, set()).add(self._rank_of(index))
        for client, held in sorted(ranks.items()):
            if len(held) > 1:
                raise ValueError(
                    f"client {client} holds stages of pipeline ranks {sorted(held)}; with stages on sub-meshes "
                    "spanning clients each client runs one pipeline rank (one thread issues its TF DTensor "
                    "ops, in the same order as the other clients of its stages)."
                )

    # -- running -------------------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: list | None = None, loss_kwargs: dict | None = None,
             **kwargs: Any) -> Any:
        """One training iteration on a whole batch: split into microbatches, run the plan, leave the
        gradients in each stage's ``grads``; returns the last stage's merged output.

        ``args`` and ``kwargs`` are the model's positional and keyword inputs (the first stage's),
        split into microbatches by ``args_chunk_spec`` / ``kwargs_chunk_spec`` (dim 0 by default;
        anything not a tensor goes to every microbatch). ``loss_kwargs`` are extra keyword
        arguments of ``loss_fn(output, target, **loss_kwargs)``, split the same way (a per-example
        weight or mask is cut with its microbatch).

        Example::

            schedule.step(x, target=y, losses=losses)
            schedule.step(tokens, target=labels, attention_mask=mask, loss_kwargs={"weights": w})
            optimizer.apply(stage.grads, stage.submod.trainable_variables)
        """
        if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
            raise TypeError(f"step(): loss_kwargs must be a dict of keyword arguments for loss_fn. Received: "
                            f"loss_kwargs={loss_kwargs!r}")
        if self._loss_fn is None:
            raise ValueError("step() trains and needs loss_fn=(output, target) -> loss on the schedule; "
                             "for forward only, call eval().")
        last = self._local.get(self._num_stages - 1)
        if target is None and last is not None:
            raise ValueError("step(): pass target=... for the last stage's loss_fn.")
        self._run(args, kwargs, target, backward=True, loss_kwargs=loss_kwargs or {})
        if losses is not None and last is not None:
            losses.extend(last.losses[m] for m in range(self._n_microbatches))
        return self._merged_output()

    def _merged_output(self) -> Any:
        """The last stage's merged output; None on a client without the last stage (as torch)."""
        last = self._local.get(self._num_stages - 1)
        if last is None:
            return None
        chunks = [out for _, out in sorted(last.output_chunks, key=lambda c: c[0])]
        return merge_chunks(chunks, self._output_merge_spec)

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, every microbatch in the plan's forward order; returns the merged output."""
        self._run(args, kwargs, None, backward=False)
        return self._merged_output()

    def _run(self, args: tuple, kwargs: dict, target: Any, backward: bool, loss_kwargs: dict | None = None) -> None:
        n = self._n_microbatches
        args_split: list = []  # per microbatch: (positional inputs, keyword inputs) of the first stage
        if 0 in self._local:  # only the first stage's client has the inputs
            args_split = list(zip(*split_args_kwargs_into_chunks(
                args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec)))
        last_here = self._num_stages - 1 in self._local
        targets = None  # per microbatch: (target, loss_fn's keyword arguments)
        if target is not None and last_here:
            split_targets, split_loss_kwargs = split_args_kwargs_into_chunks((target,), loss_kwargs, n)
            targets = [(t[0], kw) for t, kw in zip(split_targets, split_loss_kwargs)]
        for s in self._local.values():
            s.clear_runtime_states()
            s.record_for_backward = backward  # eval() keeps no activations
        self._received.clear()
        self._outgoing.clear()
        order = self._execution_order()
        # forward only: every forward of the plan, those paired with a backward in OVERLAP_F_B included
        queues = {r: [a for a in acts if a is not None] if backward else
                  [a for a in _flat(acts) if a.computation_type == F]
                  for r, acts in order.items() if self._client in self._places[self._stage_of(r)].clients}
        done: set[tuple[int, str, int | None]] = set()
        self.executed_order = {r: [] for r in queues}
        if self.concurrent:
            self._run_concurrently(queues, self._transfers(order, backward), args_split, targets, done)
        elif len({c for p in self._places.values() for c in p.clients}) > 1:
            raise ValueError("concurrent=False runs one process's whole pipeline; a pipeline across clients "
                             "runs with concurrent=True.")
        else:
            self._run_in_turn(queues, args_split, targets, done)
        if backward:  # plans without REDUCE_GRAD steps (the multi-stage ones) reduce at the end, as torch
            for s in self._local.values():
                if (s.stage_index, "reduced", None) not in done:
                    s.scale_grads(n if self.scale_grads else 1)

    def _stage_of(self, rank: int) -> int:
        """A stage of pipeline rank ``rank`` (its first)."""
        return min(i for i in self._places if self._rank_of(i) == rank)

    # -- transfers between clients -------------------------------------------------------------------
    def _channel_list(self) -> list[tuple[Channel, str, int]]:
        """This client's channels: (channel, "F" or "dx", boundary stage), one per direction of each
        boundary between this client and another; numbered alike on every client.

        Stages on sub-meshes spanning several clients pair their clients in order (the i-th client
        of stage s with the i-th of stage s + 1), as torch pairs the ranks of neighbouring stages;
        a pair holding the same coordinates of congruent sub-meshes carries its shards of each tensor
        once, any other pair the whole (replicated) tensor once.
        """
        if self._channels is None:
            self._channels = []
            self._shardwise: dict[tuple[int, str], bool] = {}  # (producing stage, "F" or "dx")
            for s in range(self._num_stages - 1):
                a, b = self._places[s], self._places[s + 1]
                if a.clients == b.clients:
                    continue
                for i, (ca, cb) in enumerate(zip(a.clients, b.clients)):
                    if self._client not in (ca, cb):
                        continue
                    src, dst = a.devices_of(ca)[0], b.devices_of(cb)[0]
                    wise = _congruent(a, ca, b, cb)
                    self._shardwise[(s, "F")] = self._shardwise[(s + 1, "dx")] = wise
                    forward = Channel(channel_index(s, 0, i), src, dst, ca == self._client, self.p2p_timeout,
                                      self._tf_mesh(s + 1))
                    backward = Channel(channel_index(s, 1, i), dst, src, cb == self._client, self.p2p_timeout,
                                       self._tf_mesh(s))
                    self._channels += [(forward, "F", s), (backward, "dx", s + 1)]
        return self._channels

    def _transfers(self, order: dict, backward: bool) -> list[tuple[Channel, str, int, list[int]]]:
        """Each channel with the microbatches it carries this step, in the order the producing stage
        makes them (both clients derive the same order from the plan)."""
        out = []
        for channel, kind, stage in self._channel_list():
            if kind == "dx" and not backward:
                continue
            wanted = (F,) if kind == "F" else (B, I)
            sequence = [a.microbatch_index for a in _flat(order[self._rank_of(stage)])
                        if a.stage_index == stage and a.computation_type in wanted]
            channel.begin_step()
            out.append((channel, kind, stage, sequence))
        return out

    def _serve(self, channel: Channel, kind: str, stage: int, sequence: list[int], cond: threading.Condition,
               done: set, failures: list) -> None:
        """A channel's thread: sends what a local stage made, or receives what a remote stage made and
        marks it done, so the local consumer becomes ready."""
        for m in sequence:
            key = (stage, kind, m)
            if channel.sending:
                with cond:
                    while not failures and key not in done:
                        cond.wait(timeout=1.0)
                    if failures:
                        return
                with cond:
                    tensors = self._outgoing.pop(key)
                channel.send(tensors)
            else:
                tensors = channel.recv()
                with cond:
                    self._received[key] = tensors
                    done.add(key)
                    cond.notify_all()

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

    def _run_concurrently(self, queues: dict, transfers: list, args_split: list, targets: list | None,
                          done: set) -> None:
        """One thread per pipeline rank, as torch has one process per rank: TensorFlow releases the
        GIL while a stage's compiled program runs, so stages on different devices overlap.  Each
        channel to another client has a thread of its own."""
        cond = threading.Condition()
        failures: list[BaseException] = []
        start = time.perf_counter()
        running: dict[int, tuple[str, float]] = {}  # rank -> (action, since): what each rank is doing
        waiting: dict[int, str] = {}  # rank -> the action whose inputs it waits for
        progress = [start]  # when an action last finished

        def rank_loop(rank: int, queue: list) -> None:
            for action in queue:
                with cond:
                    waiting[rank] = str(action)
                    while not failures and not self._ready(action, done):
                        if not cond.wait(timeout=self.p2p_timeout):
                            failures.append(RuntimeError(
                                f"pipeline rank {rank} waited {self.p2p_timeout:g} s for {action}"))
                    del waiting[rank]
                    if failures:
                        return
                    running[rank] = (str(action), time.perf_counter())
                t0 = time.perf_counter() - start
                try:
                    made = self._do_annotated(rank, action, args_split, targets)
                except BaseException as e:  # noqa: BLE001 - re-raised by step() below
                    with cond:
                        failures.append(e)
                        cond.notify_all()
                    return
                with cond:
                    del running[rank]
                    progress[0] = time.perf_counter()
                    done.update(made)
                    self.executed_order[rank].append((str(action), t0, time.perf_counter() - start))
                    cond.notify_all()

        def serve(*transfer: Any) -> None:
            try:
                self._serve(*transfer, cond, done, failures)
            except BaseException as e:  # noqa: BLE001 - re-raised by step() below
                with cond:
                    failures.append(e)
                    cond.notify_all()

        # daemons: a rank stuck inside TensorFlow cannot be stopped, and must not keep the process alive
        # after the watchdog below has raised; after a failure a receiving thread may stay blocked until
        # its transfer times out
        threads = [threading.Thread(target=rank_loop, args=(r, q), name=f"tfdist-pipeline-rank-{r}", daemon=True)
                   for r, q in sorted(queues.items())]
        channels = [threading.Thread(target=serve, args=t, name=f"tfdist-pipeline-channel-{t[0].index}",
                                     daemon=True) for t in transfers]
        for t in threads + channels:
            t.start()
        self._watch(threads, cond, failures, running, waiting, progress)
        if not failures:
            for t in channels:
                t.join()
        if failures:
            raise failures[0]

    def _watch(self, threads: list, cond: threading.Condition, failures: list, running: dict, waiting: dict,
               progress: list) -> None:
        """Waits for the rank threads; past ``stall_timeout`` seconds without an action finishing,
        records a ``PipelineStallError`` naming each rank's running or awaited action."""
        while any(t.is_alive() for t in threads):
            next(t for t in threads if t.is_alive()).join(timeout=0.2)
            with cond:
                now = time.perf_counter()
                if failures or self.stall_timeout is None or now - progress[0] <= self.stall_timeout:
                    continue
                doing = [f"rank {r} running {a} for {now - since:.0f} s" for r, (a, since) in sorted(running.items())]
                doing += [f"rank {r} waiting for the inputs of {a}" for r, a in sorted(waiting.items())]
                failures.append(PipelineStallError(
                    f"pipeline step stalled: no action finished for {now - progress[0]:.0f} s "
                    f"(schedule.stall_timeout={self.stall_timeout:g}); " + "; ".join(doing) + ". A rank "
                    "running an action is blocked inside TensorFlow; the schedule's state is lost, restart "
                    "the process."))
                cond.notify_all()
                return

    def _tf_mesh(self, stage_index: int) -> Any:
        """A local stage's TF mesh (None for a stage on one device or on another client)."""
        stage = self._local.get(stage_index)
        return stage.device.to_tf() if stage is not None and isinstance(stage.device, DeviceMesh) else None

    def _sendable(self, key: tuple[int, str], tensors: tuple) -> tuple:
        """What a channel sends (``_p2p.to_wire``): each tensor's shards or the whole tensor, made here
        on the rank's thread, so that every client of a stage spanning clients issues its TF DTensor
        ops (a relayout's collective among them) in one order."""
        self._channel_list()
        mesh = self._tf_mesh(key[0]) if self._shardwise.get(key, False) else None
        with _EAGER_LOCK:
            return tuple(to_wire(t, mesh) for t in tensors)

    def _unwire(self, stage_index: int, wires: tuple) -> tuple:
        """What a channel received, as tensors of the receiving stage (shards packed on its sub-mesh)."""
        with _EAGER_LOCK:
            return tuple(from_wire(w, self._tf_mesh(stage_index)) for w in wires)

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
        stage = self._local[s]
        if kind == F:
            keywords = {}
            if s == 0:
                inputs, keywords = args_split[m]
            elif s - 1 in self._local:
                inputs = _as_tuple(self._local[s - 1].outputs[m])
            else:  # from another client
                inputs = self._unwire(s, self._received.pop((s - 1, "F", m)))
            out = stage.forward_one_chunk(m, tuple(inputs), keywords)
            if not stage.is_last and s + 1 not in self._local:
                self._outgoing[(s, "F", m)] = self._sendable((s, "F"), _as_tuple(out))
            if stage.is_last:
                stage.output_chunks.append((m, out))
                if targets is not None:
                    stage.compute_loss(m, self._loss_fn, *targets[m])
            return {(s, "F", m)}
        if kind == REDUCE_GRAD:
            stage.scale_grads(self._n_microbatches if self.scale_grads else 1)
            return {(s, "reduced", None)}
        if kind in (B, I) and not stage.is_last:
            # the next stage's input gradients, one per tensor this stage passed it
            grads = (self._local[s + 1].input_grads[m] if s + 1 in self._local
                     else self._unwire(s, self._received.pop((s + 1, "dx", m))))
            dx = tuple(stage.place(g) for g in grads)
            stage.output_grads[m] = dx if isinstance(stage.outputs[m], (tuple, list)) else dx[0]
        loss_fn = self._loss_fn if stage.is_last else None
        stage.backward_one_chunk(m, loss_fn, inputs=kind in (B, I), weights=kind in (B, W))
        made = set()
        if kind in (B, I) and s > 0 and s - 1 not in self._local:
            self._outgoing[(s, "dx", m)] = self._sendable((s, "dx"), stage.input_grads[m])
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
    ``num_stages - rank`` microbatches are held per stage (GPipe holds all of them).

    ``pipeline_order`` is torch's plan with the microbatch numbers the run executes. torch 2.13's
    own plan numbers the last rank's forwards 1..n (its steady-state counter starts from a warm-up
    forward that rank does not have), which reads like a bug; it is kept, identical to torch's, as
    ``torch_pipeline_order``. torch runs 1F1B from its loop, not from that plan; tfdist runs
    ``pipeline_order``, whose order is that loop's.
    """

    def __init__(self, stage: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        num = (stage[0] if isinstance(stage, (list, tuple)) else stage).num_stages
        if isinstance(n_microbatches, int) and n_microbatches < num:
            raise ValueError(
                f"n_microbatches={n_microbatches}: 1F1B needs at least as many microbatches as stages ({num}); "
                f"use ScheduleGPipe or n_microbatches >= {num}."
            )
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.one_f_one_b_plan_as_run(rank, self.pp_group_size, self._n_microbatches)

    @property
    def torch_pipeline_order(self) -> dict[int, list[Action | None]]:
        """torch 2.13's ``pipeline_order`` for this schedule, exactly (the last rank's forwards numbered
        1..n)."""
        return {r: _orders.one_f_one_b_plan(r, self.pp_group_size, self._n_microbatches)
                for r in range(self.pp_group_size)}


class PipelineScheduleMulti(_PipelineSchedule):
    """Schedules with several stages per pipeline rank: rank ``r`` holds stages ``r, r + pp, ...``;
    ``pp`` is the number of distinct device groups among the stages."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None, output_merge_spec: Any = None,
                 use_full_backward: bool | None = None, scale_grads: bool = True) -> None:
        if use_full_backward is not None:  # as torch: accepted, no longer used
            warnings.warn("PipelineScheduleMulti: 'use_full_backward' is no longer supported (as in torch); "
                          "stop passing it, the schedule is unchanged.", FutureWarning, stacklevel=2)
        if not isinstance(stages, (list, tuple)) or not stages:
            raise TypeError(f"stages must be a non-empty list of PipelineStage. Received: {stages!r}")
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        groups = {p.device_key for p in self._places.values()}
        if self._num_stages % len(groups):
            raise ValueError(
                f"stages: {self._num_stages} stages on {len(groups)} device groups; every pipeline rank needs the "
                "same number of stages."
            )
        self.pp_group_size = len(groups)
        self.n_local_stages = self._num_stages // self.pp_group_size
        self._check_layout()
        for index, place in sorted(self._places.items()):  # a rank's stages share its devices (rank r holds r)
            rank = self._rank_of(index)
            if rank in self._places and place.device_key != self._places[rank].device_key:
                raise ValueError(
                    f"stages: stage {index} belongs to pipeline rank {rank}, whose stages share its devices, "
                    f"but is on other devices."
                )
        self._check_stages()
        self.pipeline_order = {r: self._plan(r) for r in range(self.pp_group_size)}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A named schedule takes torch's arguments of its class (no ``use_full_backward``)."""
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
                PipelineScheduleMulti.__init__(self, stages, n_microbatches, loss_fn, args_chunk_spec,
                                               kwargs_chunk_spec, output_merge_spec, scale_grads=scale_grads)

            __init__.__doc__ = f"{cls.__name__}(stages, n_microbatches, loss_fn=None, ...): torch's arguments."
            cls.__init__ = __init__

    def _rank_of(self, stage_index: int) -> int:
        return stage_index % self.pp_group_size

    def _check_layout(self) -> None:
        """Schedule-specific checks of the number of stages and ranks (subclasses)."""

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

    def _check_layout(self) -> None:
        _orders.interleaved_rounds(self.pp_group_size, self._n_microbatches)

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.interleaved_1f1b(rank, self.pp_group_size, self.n_local_stages, self._n_microbatches)


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Looped breadth-first: every microbatch through a rank's earlier stage before its later one."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True) -> None:
        # torch's order: no chunk specs, so a third positional argument after loss_fn is the merge spec
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads)

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.looped_bfs(rank, self.pp_group_size, self.n_local_stages, self._n_microbatches)


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved zero bubble: the interleaved plan with each backward split into its input part
    (``I``) and weight part (``W``), the weight parts filling what would be idle steps."""

    def _check_layout(self) -> None:
        _orders.interleaved_rounds(self.pp_group_size, self._n_microbatches)

    def _plan(self, rank: int) -> list[Action | None]:
        if not hasattr(self, "_plans"):
            self._plans = _orders.interleaved_zero_bubble(self.pp_group_size, self.n_local_stages,
                                                          self._n_microbatches)
        return self._plans[rank]


class _VShaped(PipelineScheduleMulti):
    """2 stages per rank, rank ``r`` holding stages ``r`` and ``2 pp - 1 - r`` (so the first and last
    stages share a rank's devices)."""

    def _check_layout(self) -> None:
        if self._num_stages != 2 * self.pp_group_size:
            raise ValueError(
                f"stages: {type(self).__name__.removeprefix('Schedule')} needs exactly 2 stages per pipeline "
                f"rank; received {self._num_stages} stages on {self.pp_group_size} device groups."
            )

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

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        num = stages[0].num_stages if isinstance(stages, (list, tuple)) and stages else 0
        if isinstance(n_microbatches, int) and n_microbatches < num:
            raise ValueError(
                f"n_microbatches={n_microbatches}: DualPipeV needs at least as many microbatches as stages "
                f"({num})."
            )
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads)

    def _plan(self, rank: int) -> list[Action | None]:
        return _orders.dualpipe_v(rank, self.pp_group_size, self._n_microbatches)

