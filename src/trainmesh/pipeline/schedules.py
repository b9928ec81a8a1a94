"""Pipeline-parallel schedules as pure data: one list of :class:`Action` per pipeline rank.

Knowing nothing of tensors, a schedule can be printed, simulated and drawn before it runs. ``p`` ranks, ``v`` chunks
per rank (rank r holds global stages r, r+p, ... [NAR, 2.2.2]), ``m`` microbatches; explicit SEND/RECV actions are
ordered to stay deadlock-free under rendezvous sends (:func:`_insert_communication`)."""

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
    """One step of a rank's schedule; ``stage`` is the global stage, also for comm actions (``SEND_F3s1``
    sends what ``F3s1`` produced)."""

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
    return {ActionKind.F: ("act", s, mb), ActionKind.B: ("grad", s, mb), ActionKind.BI: ("grad", s, mb),
            ActionKind.BW: ("wgrad", s, mb), ActionKind.RECV_F: ("act", s - 1, mb),
            ActionKind.RECV_B: ("grad", s + 1, mb)}.get(action.kind)


def action_inputs(action: Action, n_total_stages: int) -> tuple[Token, ...]:
    """Tokens that must exist on the action's rank before it can run (a RECV needs nothing local)."""
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
    """(SEND, RECV) pairs a compute action implies; consecutive stages on one rank hand over locally."""
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
    """Earliest instant in [earliest, latest] at which neither rank is mid-compute, else ``earliest``
    (free instants begin at compute ends, so only those are tried)."""
    in_range = (
        ends[bisect.bisect_right(ends, earliest) : bisect.bisect_right(ends, latest)]
        for _, ends in (sender, receiver)
    )
    candidates = [earliest, *sorted(end for ends in in_range for end in ends)]
    return next((t for t in candidates if _is_free(sender, t) and _is_free(receiver, t)), earliest)


def _insert_communication(orders: Sequence[Sequence[Action]], n_total_stages: int) -> Schedule:
    """Add SEND/RECV actions so blocking p2p cannot deadlock: each message gets a global key (a meeting time, then
    stage, kind, microbatch) and both ranks meet messages in key order, so the smallest unfinished one always
    completes."""
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
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards; bubble (p-1)/(m+p-1), m in flight."""
    _check_counts(n_stages, n_microbatches)
    mbs = range(n_microbatches)
    orders = [
        [Action(ActionKind.F, mb, rank) for mb in mbs] + [Action(ActionKind.B, mb, rank) for mb in mbs]
        for rank in range(n_stages)
    ]
    return _insert_communication(orders, n_stages)


def schedule_1f1b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B / PipeDream-Flush [NAR, 2.2.1]: p-r-1 warmup forwards, then one forward one backward, then drain.
    GPipe's bubble, but rank r holds at most min(p-r, m) microbatches."""
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
    """(stage, mb) in the order rank runs them: groups of p microbatches chunk by chunk, backwards in reverse."""
    chunks = range(n_virtual - 1, -1, -1) if reverse else range(n_virtual)
    return [
        (rank + chunk * n_stages, group + i)
        for group in range(0, n_microbatches, n_stages)
        for chunk in chunks
        for i in range(n_stages)
    ]


def schedule_interleaved_1f1b(n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """Interleaved 1F1B with ``v`` chunks per rank [NAR, 2.2.2], ``m % p == 0``: bubble (p-1) / (v·m + p-1). For v > 1
    warm-up runs p-r-1 extra forwards, as Megatron-LM, to absorb p2p latency (docs/parallel-forms.md); v = 1 is 1F1B."""
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
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2.1): 1F1B with BI, each rank r deferring its last
    r BWs into the drain (at most p microbatches held); idle (p-1)·max(t_F, t_BI, t_F + t_BI - t_BW) [ZB, 3.1]."""
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


SCHEDULES: dict[str, Callable[..., Schedule]] = {"gpipe": schedule_gpipe, "1f1b": schedule_1f1b,
                                                 "interleaved": schedule_interleaved_1f1b, "zb": schedule_zb_h1}
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
    """Move every RECV up to just after the previous comm action, so Gloo's transfer (which starts at the
    posted receive) overlaps compute. Comm order is kept, so the lists stay deadlock-free."""
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
