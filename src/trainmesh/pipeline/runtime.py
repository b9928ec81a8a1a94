"""The pipeline runtime: executes one rank's action list (:mod:`.schedules`) on real tensors, deciding nothing.

SEND/RECV runs go out as one async batch from a communication thread (shared-memory channels on one CPU host,
docs/performance.md); a compute action waits only for what it consumes. Gradients accumulate in ``.grad``, synced on
each stage's last weight-gradient action; zero bubble (Qi et al. 2023, §2) computes BI with ``torch.autograd.grad``
and BW per module in reverse forward order, each inside ``engine.backward_pass()``."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.distributed.comm import Comm, log_all_reduce
from trainmesh.training.engine import Criterion, Engine, MicroBatches
from trainmesh.training.loss import micro_loss
from trainmesh.distributed.mesh import Mesh, world_env
from trainmesh.models.documents import packed
from trainmesh.tracking.metrics import SavedActivations
from trainmesh.pipeline.partition import AXIS, partition_model, split_model
from trainmesh.pipeline.schedules import (SEND_KINDS, Action, ActionKind, Token, action_inputs, action_output,
                                          build_schedule, hoist_receives, stage_to_rank)
from trainmesh.pipeline.simulate import Costs, Timeline, TimelineRecord, concurrency

Leaf = tuple[torch.Tensor, tuple[nn.Parameter, ...]]

FORWARD_KINDS = frozenset({ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F})
WEIGHT_GRAD_KINDS = frozenset({ActionKind.B, ActionKind.BW})
GIL_SWITCH_INTERVAL = 2e-4
"""Seconds the compute thread may keep the GIL from the communication thread during a step: at Python's
default of 5 ms, a message posted between two actions leaves milliseconds late."""


@contextlib.contextmanager
def _temporarily(get: Callable[[], Any], set_: Callable[[Any], None], value: Any) -> Iterator[None]:
    """A process-wide setting (``get``/``set_``) at ``value`` inside the block, restored after it; None leaves
    it alone. Used for Python's GIL switch interval and torch's intra-op thread count during a step."""
    if value is None:
        yield
        return
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def lone_actions(schedule: Sequence[Sequence[Action]]) -> frozenset[Action]:
    """The compute actions no other rank computes during (:func:`~trainmesh.pipeline.simulate.concurrency`), which may
    use every core of a host the pipeline has to itself, since the other ranks wait."""
    return frozenset(action for action, n in concurrency(schedule).items() if n == 1)


LATENCY_ROUNDS = 20
FIT_FRACTIONS = (0.25, 0.5, 1.0)


def p2p_seconds(comm: Comm, numel: int, dtype: torch.dtype) -> float:
    """Seconds for one ``numel`` message to reach the next pipeline rank while every rank sends one (the
    slowest rank's mean over a ring exchange)."""
    mesh = comm.mesh
    p, r = mesh.size(AXIS), mesh.rank(AXIS)
    send = torch.zeros(numel, dtype=dtype, device=mesh.device)
    recv = torch.empty_like(send)
    peers = [(send, mesh.global_rank(**{AXIS: (r + 1) % p}))], [(recv, mesh.global_rank(**{AXIS: (r - 1) % p}))]
    for _ in range(2):
        for work in comm.send_recv(*peers, axis=AXIS):
            work.wait()
    dist.barrier(group=mesh.group(AXIS))
    start = time.perf_counter()
    for _ in range(LATENCY_ROUNDS):
        for work in comm.send_recv(*peers, axis=AXIS):
            work.wait()
    mean = torch.tensor([(time.perf_counter() - start) / LATENCY_ROUNDS])
    return log_all_reduce(mean, mesh.group(AXIS), dist.ReduceOp.MAX).item()


def p2p_fit(comm: Comm, numel: int, dtype: torch.dtype) -> tuple[float, float]:
    """(latency s, bandwidth B/s): a least-squares line through the times of messages of a quarter, half and all of
    ``numel`` elements, for :meth:`~trainmesh.pipeline.simulate.Costs.transfer`; a non-positive slope is all latency."""
    numels = [max(1, int(numel * f)) for f in FIT_FRACTIONS]
    times = [p2p_seconds(comm, n, dtype) for n in numels]
    sizes = [n * dtype.itemsize for n in numels]
    mean_size, mean_time = statistics.fmean(sizes), statistics.fmean(times)
    slope = (sum((b - mean_size) * (t - mean_time) for b, t in zip(sizes, times))
             / sum((b - mean_size) ** 2 for b in sizes))
    if slope <= 0:
        return mean_time, float("inf")
    return max(mean_time - slope * mean_size, 0.0), 1.0 / slope


Posting = tuple[list[list], float]
"""A posted batch's work handles, split as [sends, receive 0, receive 1, ...], and when posting returned."""


class _Posted:
    """One part of a batch of point-to-point operations (its sends, part 0, or receive i, part 1 + i), posted by the
    communication thread or through shared-memory channels; holds the tensors sent until they are gone."""

    def __init__(self, batch: Future[Posting], part: int, sending: Sequence[torch.Tensor] = ()) -> None:
        self.batch, self.part, self.sending = batch, part, list(sending)

    def wait(self) -> None:
        for work in self.batch.result()[0][self.part]:
            work.wait()
        self.sending = []


def _post_batch(comm: Comm, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> Posting:
    """Post one batch and split its handles into [sends, receive 0, ...] (Gloo: one per operation; NCCL: one shared);
    the time posting returned is when the sends left (:meth:`~trainmesh.pipeline.simulate.Timeline.transfers`)."""
    works = comm.send_recv(sends, recvs, axis=AXIS)
    posted = time.perf_counter()
    if len(works) != len(sends) + len(recvs):
        return [works] * (1 + len(recvs)), posted
    return [works[:len(sends)], *([w] for w in works[len(sends):])], posted


@dataclass
class _Stash:
    """What a stage keeps of one micro-batch between its forward and its (weight) backward."""

    input: torch.Tensor | None
    output: torch.Tensor | None
    leaves: list[Leaf]
    leaf_grads: Sequence[torch.Tensor | None] = ()


@dataclass
class _Step:
    """The state of one pass through the action list."""

    micro_batches: MicroBatches
    criterion: Criterion
    loss_scale: float
    activation_shape: tuple[int, ...]
    saved: SavedActivations | None
    loss: torch.Tensor
    divisors: Sequence[float]
    values: dict[Token, torch.Tensor] = field(default_factory=dict)
    arrivals: dict[Token, _Posted] = field(default_factory=dict)
    sends: list[tuple[list[Action], _Posted]] = field(default_factory=list)  # each batch's SENDs
    stash: dict[tuple[int, int], _Stash] = field(default_factory=dict)


class _LeafOutputs:
    """Records (output, own parameters) of every parameter-owning module while active, for the BI/BW split; a
    parameter must be used only in its owner's forward."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._active: list[Leaf] | None = None
        for module in modules:
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, _args: Any, output: Any) -> None:
        if self._active is None or not torch.is_grad_enabled():
            return
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the zero-bubble schedule needs parameter-owning modules to return one tensor; "
                            f"{type(module).__name__} returned {type(output).__name__}: use --schedule 1f1b")
        self._active.append((output, tuple(p for p in module.parameters(recurse=False) if p.requires_grad)))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Leaf]]:
        self._active = []
        try:
            yield self._active
        finally:
            self._active = None


def last_weight_gradients(actions: Sequence[Action]) -> frozenset[Action]:
    """Each stage's last B/BW in ``actions``: the one that completes its parameters' gradients."""
    last = {a.stage: a for a in actions if a.kind in WEIGHT_GRAD_KINDS}
    return frozenset(last.values())


def forward_only(actions: Sequence[Action]) -> list[Action]:
    """The forward part of a training list, for evaluation. Dropping the backward computes and their
    messages keeps the lists deadlock-free: the remaining messages keep their global order."""
    return [a for a in actions if a.kind in FORWARD_KINDS]


class PipelineRuntime:
    """Runs pipeline rank ``comm.mesh.rank('pp')``'s part of a schedule over its stage modules."""

    def __init__(self, chunks: dict[int, nn.Module], comm: Comm, schedule: str, n_microbatches: int,
                 n_virtual: int, hidden_size: int, dtype: torch.dtype, seq_shards: int = 1,
                 host_cores: int = 0) -> None:
        """``seq_shards``: ways the activations' sequence is split between stages (tp under sp); ``host_cores``: cores
        this pipeline's ranks alone share (0: none), which a lone action uses (:func:`lone_actions`)."""
        self.comm, self.mesh = comm, comm.mesh
        self.n_ranks, self.rank = self.mesh.size(AXIS), self.mesh.rank(AXIS)
        self.chunks = chunks
        self.n_stages = self.n_ranks * n_virtual
        self.n_microbatches = n_microbatches
        self.hidden_size, self.dtype, self.seq_shards = hidden_size, dtype, seq_shards
        lists = build_schedule(schedule, self.n_ranks, n_microbatches, n_virtual)
        self.schedule = [hoist_receives(actions) for actions in lists]
        self.actions = self.schedule[self.rank]
        self.eval_actions = hoist_receives(forward_only(lists[self.rank]))
        borrow = host_cores > torch.get_num_threads()
        self.lone = lone_actions(self.schedule) if borrow else frozenset()
        """Actions (of every rank) that run on all ``host_cores``; the simulator's ``Costs.lone`` times them."""
        eval_lone = lone_actions([forward_only(actions) for actions in lists]) if borrow else frozenset()
        self._threads = {a: host_cores for a in self.lone}
        self._eval_threads = {a: host_cores for a in eval_lone}
        self._syncing = last_weight_gradients(self.actions)
        split = any(a.kind is ActionKind.BI for a in self.actions)
        self._leaves = _LeafOutputs(m for c in chunks.values() for m in c.modules()) if split else None
        self.recording = False
        self.records: list[TimelineRecord] = []
        self.sent: dict[Action, float] = {}
        """When each SEND of the recorded step left (:attr:`Timeline.sent`), on the records' clock."""
        self._origin = 0.0
        self._comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainmesh-pp-comm")
        self._shared: bool | None = None  # messages go through shared-memory channels (None: not tried yet)

    # --- entry points --------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: MicroBatches, criterion: Criterion, engine: Engine,
                         saved: SavedActivations | None = None, divisors: Sequence[float] = ()) -> torch.Tensor:
        """One step's forwards and backwards; returns the loss on the last stage (each micro-batch's mean over
        ``divisors[i]``, default the micro-batch count), 0 elsewhere. ``saved`` records micro-batch 0's activation bytes."""
        step = self._new_step(micro_batches, criterion, engine.loss_scale, saved, divisors)
        self._execute(self.actions, step, engine, self._threads)
        return step.loss

    def evaluate(self, micro_batches: MicroBatches, criterion: Criterion, divisors: Sequence[float] = ()) -> torch.Tensor:
        """Forward-only pass (call under ``torch.no_grad``); the loss on the last stage (as
        :meth:`forward_backward` weighs it), 0 elsewhere."""
        step = self._new_step(micro_batches, criterion, 1.0, None, divisors)
        recording, self.recording = self.recording, False  # the recorded training step's timeline is kept
        try:
            self._execute(self.eval_actions, step, None, self._eval_threads)
        finally:
            self.recording = recording
        return step.loss

    def transfer_seconds(self, micro_batch: int, seq_len: int) -> tuple[float, float, float]:
        """Measure the link once (a collective over ``pp``): (latency s, bandwidth B/s, seconds per activation), the
        simulator's ``Costs.comm``, through a comm of its own so training's byte counts stay clean."""
        numel = micro_batch * (seq_len // self.seq_shards) * self.hidden_size
        self._open_channels(numel)
        probe = Comm(self.mesh)
        probe.channels = self.comm.channels  # the path the run's messages take
        latency, bandwidth = p2p_fit(probe, numel, self.dtype)
        return latency, bandwidth, Costs.transfer(latency, bandwidth, numel * self.dtype.itemsize)

    def gather_timeline(self) -> Timeline:
        """The last recorded step of every rank of this pipeline (a collective over ``pp``)."""
        per_rank: list = [None] * self.n_ranks
        dist.all_gather_object(per_rank, (self.records, self.sent), group=self.mesh.group(AXIS))
        return Timeline.from_records(itertools.chain.from_iterable(r for r, _ in per_rank), self.n_ranks,
                                     {a: t for _, s in per_rank for a, t in s.items()})

    # --- execution -----------------------------------------------------------------------------------

    def _new_step(self, micro_batches: MicroBatches, criterion: Criterion, loss_scale: float,
                  saved: SavedActivations | None, divisors: Sequence[float]) -> _Step:
        if len(micro_batches) != self.n_microbatches:
            raise ValueError(f"the schedule was built for {self.n_microbatches} micro-batches, got "
                             f"{len(micro_batches)}; split the batch into --microbatches pieces")
        batch, seq = micro_batches[0][0].shape
        shape = (batch, seq // self.seq_shards, self.hidden_size)
        self._open_channels(math.prod(shape))
        loss = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        return _Step(micro_batches, criterion, loss_scale, shape, saved, loss,
                     divisors or [self.n_microbatches] * self.n_microbatches)

    def _open_channels(self, numel: int) -> None:
        """At the first step (a collective over ``pp``), when the pipeline is on one CPU host: a shared-memory
        channel each way between neighbours, as deep as a step's messages, so messages move on the compute thread
        instead of waiting for a core through Gloo."""
        if self._shared is not None:
            return
        ring = [self.mesh.global_rank(pp=r) for r in range(self.n_ranks)]
        pairs = dict.fromkeys(pair for a, b in zip(ring, ring[1:] + ring[:1]) for pair in ((a, b), (b, a)))
        sends = Counter((r, stage_to_rank(a.peer_stage, self.n_ranks)) for r, actions in enumerate(self.schedule)
                        for a in actions if a.kind in SEND_KINDS)
        self._shared = self.comm.open_channels(AXIS, list(pairs), max(sends.values(), default=1),
                                               numel * self.dtype.itemsize)

    def _execute(self, actions: Sequence[Action], step: _Step, engine: Engine | None,
                 threads: dict[Action, int]) -> None:
        if self.recording:
            self._start_clock()
        with _temporarily(sys.getswitchinterval, sys.setswitchinterval, GIL_SWITCH_INTERVAL):
            for is_comm, group in itertools.groupby(actions, key=lambda a: a.is_comm):
                if is_comm:
                    self._post(list(group), step)
                else:
                    for action in group:
                        with _temporarily(torch.get_num_threads, torch.set_num_threads, threads.get(action)):
                            self._compute(action, step, engine)
            for _, posted in step.sends:
                posted.wait()
        if self.recording:
            self.sent = {a: posted.batch.result()[1] - self._origin for actions, posted in step.sends for a in actions}
        left = [*step.values, *step.arrivals, *step.stash]
        if left:
            raise RuntimeError(f"trainmesh bug: pipeline step ended with unconsumed values {left[:4]}")

    def _start_clock(self) -> None:
        """Align the ranks' clocks at a barrier, so records of different ranks share one time axis."""
        dist.barrier(group=self.mesh.group(AXIS))
        self.records, self.sent = [], {}
        self._origin = time.perf_counter()

    def _now(self) -> float:
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        return time.perf_counter() - self._origin

    def _peer(self, action: Action) -> int:
        return self.mesh.global_rank(pp=stage_to_rank(action.peer_stage, self.n_ranks))

    def _post(self, group: list[Action], step: _Step) -> None:
        start = self._now() if self.recording else 0.0
        sends, recvs, arriving = [], [], []
        for action in group:
            if action.kind in SEND_KINDS:
                (token,) = action_inputs(action, self.n_stages)
                tensor = step.values.pop(token).contiguous()
                if tensor.shape != step.activation_shape:
                    # Gloo would silently receive a message of another size into the peer's buffer.
                    raise RuntimeError(f"{action}: stage {token[1]} produced shape {tuple(tensor.shape)}, but the "
                                       f"pipeline passes {step.activation_shape} between stages")
                sends.append((tensor, self._peer(action)))
            else:
                token = action_output(action)
                buffer = torch.empty(step.activation_shape, dtype=self.dtype, device=self.mesh.device)
                step.values[token] = buffer
                recvs.append((buffer, self._peer(action)))
                arriving.append(token)
        if self._shared:  # the channels copy on this thread, at once
            batch: Future[Posting] = Future()
            batch.set_result(_post_batch(self.comm, sends, recvs))
        else:
            batch = self._comm_thread.submit(_post_batch, self.comm, sends, recvs)
        for i, token in enumerate(arriving):
            step.arrivals[token] = _Posted(batch, 1 + i)
        if sends:
            step.sends.append(([a for a in group if a.kind in SEND_KINDS], _Posted(batch, 0, [t for t, _ in sends])))
        if self.recording:  # the group's posting time, shared evenly by its actions
            each = (self._now() - start) / len(group)
            self.records += [TimelineRecord(self.rank, a, start + i * each, start + (i + 1) * each)
                             for i, a in enumerate(group)]

    def _compute(self, action: Action, step: _Step, engine: Engine | None) -> None:
        for token in action_inputs(action, self.n_stages):
            posted = step.arrivals.pop(token, None)
            if posted is not None:
                posted.wait()
        start = self._now() if self.recording else 0.0
        run = {ActionKind.F: self._forward, ActionKind.B: self._backward,
               ActionKind.BI: self._backward_input, ActionKind.BW: self._backward_weight}[action.kind]
        _, _, *packing = step.micro_batches[action.microbatch]
        with packed(*packing):  # the micro-batch's documents, for its forward and any recomputation in backward
            run(action, step, engine)
        if self.recording:
            self.records.append(TimelineRecord(self.rank, action, start, self._now()))

    def _sync(self, action: Action, engine: Engine | None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if action in self._syncing else engine.no_sync()

    def _recording_leaves(self) -> contextlib.AbstractContextManager[list[Leaf]]:
        if self._leaves is None or not torch.is_grad_enabled():
            return contextlib.nullcontext([])
        return self._leaves.recording()

    def _forward(self, action: Action, step: _Step, _engine: Engine | None) -> None:
        s, mb = action.stage, action.microbatch
        x, y, *_ = step.micro_batches[mb]
        if s > 0:
            x = step.values.pop(("act", s - 1, mb)).requires_grad_(torch.is_grad_enabled())
        saving = step.saved.recording() if step.saved is not None and mb == 0 else contextlib.nullcontext()
        last = s == self.n_stages - 1
        with saving:  # the loss too: it saves the fp32 logits, as it does without a pipeline
            with self._recording_leaves() as leaves:
                out = self.chunks[s](x)
            if last:
                out = micro_loss(step.criterion, out, y, step.divisors[mb])
        if last:
            step.loss += out.detach()
        else:
            step.values[("act", s, mb)] = out.detach()
        if torch.is_grad_enabled():
            step.stash[(s, mb)] = _Stash(x if s > 0 else None, out, leaves)

    def _root(self, action: Action, step: _Step, stash: _Stash) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What backward starts from: the scaled loss on the last stage, else the output and its gradient."""
        if action.stage == self.n_stages - 1:
            return stash.output * step.loss_scale, None
        return stash.output, step.values.pop(("grad", action.stage + 1, action.microbatch))

    def _backward(self, action: Action, step: _Step, engine: Engine | None) -> None:
        stash = step.stash.pop((action.stage, action.microbatch))
        root, grad = self._root(action, step, stash)
        with self._sync(action, engine), engine.backward_pass():
            torch.autograd.backward(root, grad)
        if stash.input is not None:
            step.values[("grad", action.stage, action.microbatch)] = stash.input.grad

    def _backward_input(self, action: Action, step: _Step, engine: Engine | None) -> None:
        stash = step.stash[(action.stage, action.microbatch)]
        root, grad = self._root(action, step, stash)
        inputs = [stash.input] if stash.input is not None else []
        with engine.backward_pass(input_only=True):
            grads = torch.autograd.grad(root, inputs + [z for z, _ in stash.leaves], grad,
                                        retain_graph=True, allow_unused=True)
        if stash.input is not None:
            step.values[("grad", action.stage, action.microbatch)] = grads[0]
        stash.leaf_grads = grads[len(inputs):]
        stash.input = stash.output = None

    def _backward_weight(self, action: Action, step: _Step, engine: Engine | None) -> None:
        stash = step.stash.pop((action.stage, action.microbatch))
        leaves = list(zip(stash.leaves, stash.leaf_grads, strict=True))
        with self._sync(action, engine), engine.backward_pass():
            for (z, params), grad in reversed(leaves):
                if grad is not None:
                    engine.unshard_for_backward(params)
                    # retain_graph: two modules' weight paths may share a node; the stash's release frees it.
                    torch.autograd.backward(z, grad, inputs=list(params), retain_graph=True)


def build_pipeline(model: nn.Module, comm: Comm, schedule: str, microbatches: int, hidden_size: int,
                   dtype: torch.dtype, virtual_stages: int = 1, layers_per_stage: Sequence[int] = (),
                   seq_shards: int = 1) -> tuple[nn.Module, PipelineRuntime]:
    """Cut ``model`` in place to this rank's stage(s) (``layers_per_stage``, else balanced by parameters) and build
    the runtime for ``schedule``; ``hidden_size``/``dtype`` describe the activations so receives can be posted early."""
    mesh = comm.mesh
    n_ranks = mesh.size(AXIS)
    layers = partition_model(model, n_ranks * virtual_stages, layers_per_stage)
    part, chunks = split_model(model, layers, mesh.rank(AXIS), n_ranks, virtual_stages)
    runtime = PipelineRuntime(chunks, comm, schedule, microbatches, virtual_stages, hidden_size, dtype,
                              seq_shards=seq_shards, host_cores=_pipeline_host_cores(mesh))
    return part, runtime


def _pipeline_host_cores(mesh: Mesh) -> int:
    """The cores this process may run on when the job is this one pipeline on one CPU host (so a rank the
    schedule leaves alone may use the idle ranks' cores), else 0."""
    alone = mesh.device.type == "cpu" and dist.get_world_size() == mesh.size(AXIS) == world_env().local_world_size
    return len(os.sched_getaffinity(0)) if alone else 0
