"""Pipeline-parallel schedules as pure data: one list of :class:`Action` per pipeline rank.

A schedule says *what* each rank does and *in which order*; it knows nothing about tensors or
processes, so it can be printed, simulated and verified (:mod:`trainmesh.pipeline.simulate`) and
drawn (:mod:`trainmesh.pipeline.draw`) before a runtime ever executes it.

Vocabulary
----------
* ``p`` (``n_stages``): the pipeline-parallel degree, i.e. the number of ranks in the pipeline.
* ``v`` (``n_virtual``): model chunks per rank (Narayanan et al. 2021, §2.2.2). The model is cut
  into ``p * v`` *global stages* ``0 .. p*v-1``; rank ``r`` holds stages ``r, r+p, r+2p, ...``
  (:func:`stage_to_rank`, :func:`rank_stages`). Without interleaving ``v == 1`` and stage == rank.
* ``m`` (``n_microbatches``): microbatches per optimizer step.

Communication is explicit: a compute action whose product is consumed on another rank is followed
(later in the producer's list) by a ``SEND_*`` and preceded (earlier in the consumer's list) by the
matching ``RECV_*``. The runtime executes exactly these lists, one action at a time. The comm
actions are ordered so that the lists stay deadlock-free even when every send blocks until the peer
reaches the matching receive (rendezvous, the strictest semantics a p2p backend may have), and
messages between two ranks are met in the same order on both; see :func:`_insert_communication`
for the construction and the argument, and :func:`trainmesh.pipeline.simulate.simulate`, which
checks it for any list.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Token = tuple[str, int, int]
"""A value a stage produces: ``("act", stage, mb)`` (output activation; also stands for the
activations the stage stashed for its backward), ``("grad", stage, mb)`` (gradient w.r.t. the
stage's input) or ``("wgrad", stage, mb)`` (weight gradients accumulated)."""

Schedule = list[list["Action"]]


class ActionKind(str, enum.Enum):
    """What one step of a rank's list does."""

    F = "F"  # forward of one microbatch through one stage
    B = "B"  # full backward: input grad and weight grad together
    BI = "BI"  # backward for the input only (zero-bubble "B" pass)
    BW = "BW"  # backward for the weights only (zero-bubble "W" pass)
    SEND_F = "SEND_F"  # send the output activation of `stage` to stage + 1
    RECV_F = "RECV_F"  # receive the input activation of `stage` from stage - 1
    SEND_B = "SEND_B"  # send the gradient w.r.t. the input of `stage` to stage - 1
    RECV_B = "RECV_B"  # receive the gradient w.r.t. the output of `stage` from stage + 1

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.BI, ActionKind.BW})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
_PARTNER_KIND = {ActionKind.SEND_F: ActionKind.RECV_F, ActionKind.RECV_F: ActionKind.SEND_F,
                 ActionKind.SEND_B: ActionKind.RECV_B, ActionKind.RECV_B: ActionKind.SEND_B}
BACKWARD_KINDS = frozenset({ActionKind.B, ActionKind.BI})
"""Kinds that produce the input gradient, i.e. what the previous stage's backward waits for."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule.

    ``stage`` is the *global* stage the action belongs to, also for comm actions: ``SEND_F3s1``
    sends what ``F3s1`` produced, ``RECV_F3s2`` receives what ``F3s2`` consumes.
    """

    kind: ActionKind
    microbatch: int
    stage: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise TypeError(f"Action.kind must be an ActionKind (e.g. ActionKind.F), got {self.kind!r}")
        if self.microbatch < 0 or self.stage < 0:
            raise ValueError(f"Action needs microbatch >= 0 and stage >= 0, got {self.microbatch}, {self.stage}")

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}s{self.stage}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def peer_stage(self) -> int:
        """The stage on the other end of a comm action (its rank is ``stage_to_rank(peer_stage, p)``)."""
        if self.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self.stage + 1
        if self.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
            return self.stage - 1
        raise ValueError(f"{self} is a compute action; only SEND_*/RECV_* actions have a peer stage")

    @property
    def partner(self) -> Action:
        """The action on the peer rank that completes a comm action (SEND_F3s1 <-> RECV_F3s2)."""
        return Action(_PARTNER_KIND[self.kind], self.microbatch, self.peer_stage)


def stage_to_rank(stage: int, n_ranks: int) -> int:
    """Rank holding global ``stage``: chunks are dealt round-robin (Narayanan et al. 2021, §2.2.2)."""
    return stage % n_ranks


def rank_stages(rank: int, n_ranks: int, n_virtual: int = 1) -> tuple[int, ...]:
    """Global stages held by ``rank``, in model order: ``rank, rank + p, rank + 2p, ...``."""
    if not 0 <= rank < n_ranks:
        raise ValueError(f"rank {rank} is outside the pipeline of {n_ranks} ranks (0..{n_ranks - 1})")
    return tuple(rank + chunk * n_ranks for chunk in range(n_virtual))


def action_output(action: Action) -> Token | None:
    """The token ``action`` makes available on its own rank (a RECV delivers its peer's product)."""
    mb, s = action.microbatch, action.stage
    return {
        ActionKind.F: ("act", s, mb),
        ActionKind.B: ("grad", s, mb),
        ActionKind.BI: ("grad", s, mb),
        ActionKind.BW: ("wgrad", s, mb),
        ActionKind.RECV_F: ("act", s - 1, mb),
        ActionKind.RECV_B: ("grad", s + 1, mb),
    }.get(action.kind)


def action_inputs(action: Action, n_total_stages: int) -> tuple[Token, ...]:
    """Tokens that must exist on the action's rank before it can run.

    F needs the previous stage's activation; B/BI need this stage's stashed activation and the
    next stage's input gradient; BW needs its BI (which leaves behind the output gradient);
    a SEND needs what it sends. A RECV needs nothing locally: it waits for its peer's SEND.
    """
    mb, s = action.microbatch, action.stage
    kind = action.kind
    if kind is ActionKind.F:
        return (("act", s - 1, mb),) if s > 0 else ()
    if kind in BACKWARD_KINDS:
        upstream = (("grad", s + 1, mb),) if s < n_total_stages - 1 else ()
        return (("act", s, mb), *upstream)
    if kind is ActionKind.BW:
        return (("grad", s, mb),)
    if kind is ActionKind.SEND_F:
        return (("act", s, mb),)
    if kind is ActionKind.SEND_B:
        return (("grad", s, mb),)
    return ()


def required_messages(action: Action, n_ranks: int, n_total_stages: int) -> tuple[tuple[Action, Action], ...]:
    """(SEND, RECV) pairs a compute action implies: its product is needed on a different rank.

    Consecutive stages on one rank (only when ``p == 1``) hand over locally, without a message.
    """
    mb, s = action.microbatch, action.stage
    rank = stage_to_rank(s, n_ranks)
    if action.kind is ActionKind.F and s < n_total_stages - 1 and stage_to_rank(s + 1, n_ranks) != rank:
        return ((Action(ActionKind.SEND_F, mb, s), Action(ActionKind.RECV_F, mb, s + 1)),)
    if action.kind in BACKWARD_KINDS and s > 0 and stage_to_rank(s - 1, n_ranks) != rank:
        return ((Action(ActionKind.SEND_B, mb, s), Action(ActionKind.RECV_B, mb, s - 1)),)
    return ()


_Busy = tuple[list[float], list[float]]
"""A rank's compute start times and end times, in execution order."""

# Costs used only to *place* comm actions (F=1, B=2 = BI + BW, the usual "backward is twice the
# forward" assumption). Deadlock-freedom of the result does not depend on them.
_PLACEMENT_COST = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.BI: 1.0, ActionKind.BW: 1.0}


def _ideal_times(orders: Sequence[Sequence[Action]], n_total_stages: int) -> dict[Action, tuple[float, float]]:
    """(start, end) of every compute action when products reach other ranks instantly."""
    ready: dict[Token, float] = {}
    times: dict[Action, tuple[float, float]] = {}
    position = [0] * len(orders)
    free_at = [0.0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = order[position[rank]]
                needed = action_inputs(action, n_total_stages)
                if any(token not in ready for token in needed):
                    break
                start = max([free_at[rank], *(ready[token] for token in needed)])
                end = start + _PLACEMENT_COST[action.kind]
                times[action] = (start, end)
                ready[action_output(action)] = end
                free_at[rank] = end
                position[rank] += 1
                progressed = True
    if any(position[rank] < len(order) for rank, order in enumerate(orders)):
        raise RuntimeError("trainmesh bug: a built-in compute order deadlocks; please report it")
    return times


def _busy_intervals(order: Sequence[Action], times: dict[Action, tuple[float, float]]) -> _Busy:
    """Starts and ends of a rank's compute, in order (starts strictly increase: costs are > 0)."""
    return [times[a][0] for a in order], [times[a][1] for a in order]


def _is_free(busy: _Busy, instant: float) -> bool:
    """Whether the rank is between two compute actions (or idle) at ``instant``."""
    starts, ends = busy
    i = bisect.bisect_left(starts, instant) - 1
    return i < 0 or ends[i] <= instant


def _meeting_time(earliest: float, latest: float, sender: _Busy, receiver: _Busy) -> float:
    """Earliest instant in [earliest, latest] at which neither rank is mid-compute.

    The free instants of a rank form closed intervals that begin at compute ends, so the first
    common one is ``earliest`` or some compute end in range. Without one, one of the two ranks has
    to wait whatever we choose (the compute order, not the comm order, causes it); ``earliest``.
    """
    in_range = (
        ends[bisect.bisect_right(ends, earliest) : bisect.bisect_right(ends, latest)]
        for _, ends in (sender, receiver)
    )
    candidates = [earliest, *sorted(end for ends in in_range for end in ends)]
    return next((t for t in candidates if _is_free(sender, t) and _is_free(receiver, t)), earliest)


def _insert_communication(orders: Sequence[Sequence[Action]], n_total_stages: int) -> Schedule:
    """Add SEND/RECV actions to per-rank compute orders so that blocking p2p cannot deadlock.

    Every message gets one global key: a meeting time between its producer's end and its
    consumer's start (ideal times, :data:`_PLACEMENT_COST`) at which both ranks are between
    compute actions, then stage, kind, microbatch to break ties. Each rank sorts its actions by
    time; a comm action sorts by its key and before a compute action starting at the same instant.
    So a SEND follows its producer, a RECV precedes its consumer, and *both ranks meet their
    messages in the same global key order*. Why that suffices under rendezvous semantics: take the
    unfinished message with the smallest key; everything before it on both endpoint ranks is a
    finished message or compute whose inputs are local or already received, so both ranks reach it
    and it completes. That argument does not use the placement costs, so the lists cannot deadlock
    for any real durations. The meeting time only matters to a runtime whose sends block: there a
    sender that reaches its SEND while the receiver computes waits, and that wait is idle time.
    """
    n_ranks = len(orders)
    times = _ideal_times(orders, n_total_stages)
    busy = [_busy_intervals(order, times) for order in orders]
    consumer_start = {
        (rank, token): times[action][0]
        for rank, order in enumerate(orders)
        for action in order
        for token in action_inputs(action, n_total_stages)
    }
    keyed: list[list[tuple[tuple, Action]]] = [[] for _ in range(n_ranks)]
    for rank, order in enumerate(orders):
        for action in order:
            start, end = times[action]
            keyed[rank].append(((start, 1), action))
            for send, recv in required_messages(action, n_ranks, n_total_stages):
                peer = stage_to_rank(recv.stage, n_ranks)
                latest = consumer_start[(peer, action_output(action))]
                meet = _meeting_time(end, latest, busy[rank], busy[peer])
                key = (meet, 0, action.stage, action.kind.value, action.microbatch)
                keyed[rank].append((key, send))
                keyed[peer].append((key, recv))
    return [[action for _, action in sorted(items, key=lambda item: item[0])] for items in keyed]


def _check_counts(n_stages: int, n_microbatches: int, n_virtual: int = 1) -> None:
    for name, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches), ("n_virtual", n_virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _one_f_one_b(forwards: Sequence[Action], backwards: Sequence[Action], n_warmup: int) -> list[Action]:
    """Warmup forwards, then alternate one forward / one backward, then the remaining backwards."""
    n_warmup = min(n_warmup, len(forwards))
    order = list(forwards[:n_warmup])
    for forward, backward in zip(forwards[n_warmup:], backwards, strict=False):
        order += [forward, backward]
    order += backwards[len(forwards) - n_warmup :]
    return order


def schedule_gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every rank runs all m forwards, then all m backwards.

    Bubble fraction (p-1)/(m+p-1) for uniform stages; holds activations of all m microbatches.
    """
    _check_counts(n_stages, n_microbatches)
    mbs = range(n_microbatches)
    orders = [
        [Action(ActionKind.F, mb, rank) for mb in mbs] + [Action(ActionKind.B, mb, rank) for mb in mbs]
        for rank in range(n_stages)
    ]
    return _insert_communication(orders, n_stages)


def schedule_1f1b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021, §2.2.1).

    Rank r runs ``p-r-1`` warmup forwards, then alternates one forward and one backward, then drains
    the remaining backwards. Same bubble as GPipe, (p-1)/(m+p-1), but rank r never holds more than
    ``min(p-r, m)`` microbatches of activations (p on rank 0) instead of m.
    """
    _check_counts(n_stages, n_microbatches)
    orders = []
    for rank in range(n_stages):
        forwards = [Action(ActionKind.F, mb, rank) for mb in range(n_microbatches)]
        backwards = [Action(ActionKind.B, mb, rank) for mb in range(n_microbatches)]
        orders.append(_one_f_one_b(forwards, backwards, n_stages - rank - 1))
    return _insert_communication(orders, n_stages)


def _interleaved_order(
    rank: int, n_stages: int, n_microbatches: int, n_virtual: int, *, reverse: bool
) -> list[tuple[int, int]]:
    """(stage, mb) in the order rank runs them: groups of p microbatches, chunk by chunk.

    Forwards walk the chunks in model order, backwards in reverse (Narayanan et al. 2021, §2.2.2).
    """
    chunks = range(n_virtual - 1, -1, -1) if reverse else range(n_virtual)
    return [
        (rank + chunk * n_stages, group + i)
        for group in range(0, n_microbatches, n_stages)
        for chunk in chunks
        for i in range(n_stages)
    ]


def schedule_interleaved_1f1b(n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """Interleaved 1F1B with ``v`` model chunks per rank (Narayanan et al. 2021, §2.2.2).

    Rank r holds chunks r, r+p, ...; microbatches go in groups of p through chunk 0 of every rank,
    then chunk 1, ... (backwards in reverse chunk order), hence ``m % p == 0``. A chunk costs 1/v
    of a full stage, so filling and draining the pipeline costs (p-1)·(t_f+t_b)/v while the useful
    work stays m·(t_f+t_b): with per-chunk costs f, b the bubble fraction (idle / total over ranks)
    is exactly ``(p-1) / (v·m + p-1)`` — the paper's bubble/ideal ratio (p-1)/(v·m), v times less
    bubble time than 1F1B. The simulator reproduces it for any f:b when comm is free.

    Warmup on rank r: its first backward is microbatch 0 in its last chunk; before it the rank runs
    group 0 through its first v-1 chunks ((v-1)·p forwards) plus, as in 1F1B, p-r-1 more. That
    already reaches the bubble above when comm is free; for v > 1 we add p-r-1 more, as
    Megatron-LM does, because every microbatch crosses v times more links and the slack absorbs
    their latency (simulated, p=4, m=16, v=2, comm = 0.2·f: bubble 0.11 instead of 0.17) at the
    price of p-r-1 more chunk activations. With v = 1 the schedule is exactly 1F1B.
    """
    _check_counts(n_stages, n_microbatches, n_virtual)
    if n_microbatches % n_stages:
        lower = n_microbatches - n_microbatches % n_stages
        upper = lower + n_stages
        options = f"m={lower} or m={upper}" if lower else f"m={upper}"
        raise ValueError(
            f"interleaved 1F1B needs n_microbatches to be a multiple of n_stages (got m={n_microbatches}, "
            f"p={n_stages}): microbatches go through the model chunks in groups of p. "
            f"Choose {options}, or use the '1f1b' schedule."
        )
    n_total = n_stages * n_virtual
    orders = []
    for rank in range(n_stages):
        forward_order = _interleaved_order(rank, n_stages, n_microbatches, n_virtual, reverse=False)
        backward_order = _interleaved_order(rank, n_stages, n_microbatches, n_virtual, reverse=True)
        forwards = [Action(ActionKind.F, mb, stage) for stage, mb in forward_order]
        backwards = [Action(ActionKind.B, mb, stage) for stage, mb in backward_order]
        latency_slack = n_stages - rank - 1 if n_virtual > 1 else 0
        n_warmup = (n_virtual - 1) * n_stages + n_stages - rank - 1 + latency_slack
        orders.append(_one_f_one_b(forwards, backwards, n_warmup))
    return _insert_communication(orders, n_total)


def schedule_zb_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2.1 "memory efficient schedule").

    The backward is split into BI (input gradient, on the critical path between ranks) and BW
    (weight gradient, needed by nobody else until the optimizer step). Rank r follows 1F1B with BI
    in place of B, but keeps its last ``r`` BWs pending and runs them while it would otherwise wait
    for the drain. Rank r then holds at most ``(p-r) + r = p`` microbatches (a microbatch stays in
    flight until its BW), the peak of rank 0 in 1F1B. With t_F = t_BI = t_BW = t (the paper's
    setting) each rank idles (p-1)·t, a third of 1F1B's (p-1)·3t: bubble fraction
    ``(p-1) / (3m + p-1)``. In general (m >= p) the simulated idle per rank is
    (p-1)·max(t_F, t_BI, t_F + t_BI - t_BW); the last term is the paper's estimate (p-1)(t_F+t_B-t_W), the
    first two are floors: the last rank waits (p-1)·t_F for its first F, and rank 0, holding p
    microbatches, has nothing to run while its first BI crosses the other p-1 ranks.
    """
    _check_counts(n_stages, n_microbatches)
    orders = []
    for rank in range(n_stages):
        n_warmup = min(n_stages - rank - 1, n_microbatches)
        order = [Action(ActionKind.F, mb, rank) for mb in range(n_warmup)]
        pending: deque[int] = deque()
        for mb in range(n_microbatches):
            if n_warmup + mb < n_microbatches:
                order.append(Action(ActionKind.F, n_warmup + mb, rank))
            order.append(Action(ActionKind.BI, mb, rank))
            pending.append(mb)
            if len(pending) > rank:
                order.append(Action(ActionKind.BW, pending.popleft(), rank))
        order += [Action(ActionKind.BW, mb, rank) for mb in pending]
        orders.append(order)
    return _insert_communication(orders, n_stages)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": schedule_gpipe,
    "1f1b": schedule_1f1b,
    "interleaved": schedule_interleaved_1f1b,
    "zb": schedule_zb_h1,
}
VIRTUAL_SCHEDULES = frozenset({"interleaved"})
"""Schedules that take ``n_virtual``; the others hold exactly one stage per rank."""


def build_schedule(name: str, n_stages: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """Build the schedule registered as ``name`` after checking the arguments fit it."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    _check_counts(n_stages, n_microbatches, n_virtual)
    if name in VIRTUAL_SCHEDULES:
        return SCHEDULES[name](n_stages, n_microbatches, n_virtual)
    if n_virtual != 1:
        raise ValueError(
            f"schedule {name!r} holds one stage per rank; n_virtual={n_virtual} needs the 'interleaved' "
            f"schedule (or pass n_virtual=1)"
        )
    return SCHEDULES[name](n_stages, n_microbatches)


def hoist_receives(actions: Sequence[Action]) -> list[Action]:
    """Move every RECV up past the compute actions before it, to just after the previous comm action.

    Gloo (like a rendezvous protocol) starts moving a message only once its receive is posted, so a RECV
    posted right before its consumer costs a full transfer; posted earlier, the transfer overlaps that
    compute. Comm actions keep their order, so messages still match FIFO, and the lists stay
    deadlock-free even with blocking sends: the argument of
    :func:`~trainmesh.pipeline.schedules._insert_communication` only needs each rank to meet its messages
    in key order, with every compute after the receives it consumes (the tests simulate it).
    """
    out: list[Action] = []
    after_last_comm = 0
    for action in actions:
        if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            out.insert(after_last_comm, action)
            after_last_comm += 1
        else:
            out.append(action)
            if action.is_comm:
                after_last_comm = len(out)
    return out
