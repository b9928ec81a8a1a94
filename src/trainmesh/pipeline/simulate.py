"""Simulate and verify a pipeline schedule; its :class:`Timeline` is also what a runtime builds from measured
timestamps, so simulated and real runs are analysed alike. Verification treats SEND/RECV as a rendezvous (the
strictest semantics); bubble fraction = ``1 - sum(busy) / (p · makespan)``, busy counting compute only."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainmesh.pipeline.schedules import (Action, COMPUTE_KINDS, SEND_KINDS, ActionKind, Token, action_inputs,
                                          action_output, required_messages, stage_to_rank)

Cost = float | tuple[float, ...]
"""Seconds (or any unit) for one action: one value for all stages, or one per global stage."""

_COMPUTE_ORDER = (ActionKind.F, ActionKind.B, ActionKind.BI, ActionKind.BW)
_SPLIT_BACKWARD = (ActionKind.BI, ActionKind.BW)


class ScheduleError(ValueError):
    """The schedule cannot run: it deadlocks, misses or repeats an action, or misplaces one."""


@dataclass(frozen=True)
class Costs:
    """Duration of each action kind; backward halves default to half of ``backward`` (Qi et al. 2023, §2).
    ``comm`` a message's transfer, ``post`` a SEND/RECV's host cost, ``dispatch`` the gap between actions
    (all 0: the textbook setting); ``lone`` scales actions no other rank overlaps (borrowed cores)."""

    forward: Cost = 1.0
    backward: Cost = 2.0
    backward_input: Cost | None = None
    backward_weight: Cost | None = None
    comm: float = 0.0
    post: float = 0.0
    dispatch: float = 0.0
    lone: float = 1.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            if value is not None and any(v <= 0 for v in values):
                raise ValueError(f"Costs.{name} must be > 0 (a free compute action would hide bubbles), got {value}")
        if self.lone <= 0:
            raise ValueError(f"Costs.lone must be > 0 (a duration multiplier), got {self.lone}")
        for name in ("comm", "post", "dispatch"):
            if getattr(self, name) < 0:
                raise ValueError(f"Costs.{name} must be >= 0, got {getattr(self, name)}")

    @staticmethod
    def transfer(latency: float, bandwidth: float, nbytes: int) -> float:
        """Seconds for one ``nbytes`` message under the latency/bandwidth (alpha-beta) model (Hockney 1994):
        ``latency + nbytes / bandwidth``, bandwidth in bytes per second."""
        if latency < 0 or bandwidth <= 0:
            raise ValueError(f"need latency >= 0 and bandwidth > 0, got {latency} s and {bandwidth} B/s")
        return latency + nbytes / bandwidth

    def save(self, path: str | Path) -> Path:
        """Write the costs as JSON, for ``trainmesh schedule --costs``."""
        Path(path).write_text(json.dumps(asdict(self), indent=1))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Costs:
        """Costs written by :meth:`save` (``trainmesh train --timeline`` writes them beside its picture)."""
        try:
            fields = json.loads(Path(path).read_text())
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"cannot read pipeline costs from {path}: {e}; write them with "
                             "trainmesh train --timeline PNG (they land in PNG's .costs.json)") from e

    def duration(self, action: Action) -> float:
        if action.is_comm:
            return self.comm
        half = _scaled(self.backward, 0.5)
        cost = {ActionKind.F: self.forward, ActionKind.B: self.backward,
                ActionKind.BI: half if self.backward_input is None else self.backward_input,
                ActionKind.BW: half if self.backward_weight is None else self.backward_weight}[action.kind]
        if not isinstance(cost, tuple):
            return cost
        if action.stage >= len(cost):
            raise ValueError(
                f"per-stage cost {cost} has no entry for stage {action.stage}; "
                "give one value per global stage"
            )
        return cost[action.stage]


def _scaled(cost: Cost, factor: float) -> Cost:
    return tuple(c * factor for c in cost) if isinstance(cost, tuple) else cost * factor


@dataclass(frozen=True)
class TimelineRecord:
    """One executed action: simulated, or measured by a runtime (any clock, same one on all ranks)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """What ran where and when (build with :meth:`from_records`); ``sent``: when each SEND's data was handed to
    the transport, empty when simulated."""

    records: tuple[TimelineRecord, ...]
    n_ranks: int
    sent: Mapping[Action, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.n_ranks < 1:
            raise ValueError(f"a timeline needs n_ranks >= 1, got {self.n_ranks}")
        for record in self.records:
            if not 0 <= record.rank < self.n_ranks:
                raise ValueError(f"record {record} is on rank {record.rank}, outside 0..{self.n_ranks - 1}")
            if record.end < record.start:
                raise ValueError(f"record {record} ends before it starts; check the clock used to measure it")

    @classmethod
    def from_records(cls, records: Iterable[TimelineRecord], n_ranks: int | None = None,
                     sent: Mapping[Action, float] | None = None) -> Timeline:
        """Sort by (rank, start); ``n_ranks`` defaults to the highest rank seen + 1."""
        ordered = tuple(sorted(records, key=lambda r: (r.rank, r.start, r.end)))
        if n_ranks is None:
            n_ranks = max((r.rank for r in ordered), default=0) + 1
        return cls(ordered, n_ranks, dict(sent or {}))

    def transfers(self, link: float) -> dict[Action, float]:
        """Each measured message's transfer time (keyed by its SEND): from the later post until its send returned,
        plus ``link``, an idle link's time."""
        posted = {r.action: r.start for r in self.records if r.action.is_comm}
        return {send: max(at - max(posted[send], posted.get(send.partner, posted[send])), 0.0) + link
                for send, at in self.sent.items() if send in posted}

    def rank_records(self, rank: int) -> tuple[TimelineRecord, ...]:
        return tuple(r for r in self.records if r.rank == rank)

    @property
    def makespan(self) -> float:
        if not self.records:
            return 0.0
        return max(r.end for r in self.records) - min(r.start for r in self.records)

    @property
    def busy_times(self) -> tuple[float, ...]:
        """Compute time per rank."""
        return tuple(
            sum(r.duration for r in self.rank_records(rank) if r.action.is_compute)
            for rank in range(self.n_ranks)
        )

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ``n_ranks · makespan``; (p-1)/(m+p-1) for GPipe/1F1B with uniform stages."""
        total = self.n_ranks * self.makespan
        return 0.0 if total == 0 else 1.0 - sum(self.busy_times) / total

    @property
    def peak_activations(self) -> tuple[int, ...]:
        """Most microbatches whose activations a rank holds at once, per rank: from F until B, or until BW with a
        split backward (Qi et al. 2023, §2.1); counted in execution order."""
        peaks = []
        for rank in range(self.n_ranks):
            held = peak = 0
            for record in self.rank_records(rank):
                if record.action.kind is ActionKind.F:
                    held += 1
                    peak = max(peak, held)
                elif record.action.kind in (ActionKind.B, ActionKind.BW):
                    held -= 1
            peaks.append(peak)
        return tuple(peaks)


def measured_costs(timelines: Sequence[Timeline], n_stages: int, comm: float,
                   lone: Collection[Action] = frozenset()) -> Costs:
    """Mean measured duration of each compute kind per stage and of posting a message (a mean, so the total
    work matches the measured step); dispatch is the median gap; ``lone`` actions are kept apart. ``comm``
    is the mean of :meth:`Timeline.transfers` where sends were recorded."""
    durations: dict[tuple[ActionKind, int], list[float]] = defaultdict(list)
    alone: list[TimelineRecord] = []
    posts, gaps = [], []
    transfers = [t for timeline in timelines for t in timeline.transfers(comm).values()]
    for timeline in timelines:
        for rank in range(timeline.n_ranks):
            records = timeline.rank_records(rank)
            gaps += [after.start - before.end for before, after in zip(records, records[1:])]
        for record in timeline.records:
            if record.action in lone:
                alone.append(record)
            elif record.action.kind in COMPUTE_KINDS:
                durations[(record.action.kind, record.action.stage)].append(record.duration)
            else:
                posts.append(record.duration)

    def per_stage(kind: ActionKind) -> tuple[float, ...] | None:
        if (kind, 0) not in durations:
            return None
        return tuple(max(statistics.fmean(durations[(kind, s)]), 1e-9) for s in range(n_stages))

    ratios = [r.duration / statistics.fmean(durations[(r.action.kind, r.action.stage)]) for r in alone
              if durations[(r.action.kind, r.action.stage)]]
    for record in alone:  # a kind and stage that only ever runs alone keeps its own time
        if not durations[(record.action.kind, record.action.stage)]:
            durations[(record.action.kind, record.action.stage)].append(record.duration)
    bi, bw = per_stage(ActionKind.BI), per_stage(ActionKind.BW)
    backward = per_stage(ActionKind.B) or tuple(i + w for i, w in zip(bi, bw))
    return Costs(forward=per_stage(ActionKind.F), backward=backward, backward_input=bi, backward_weight=bw,
                 comm=statistics.fmean(transfers) if transfers else comm,
                 post=statistics.fmean(posts) if posts else 0.0,
                 dispatch=max(statistics.median(gaps), 0.0) if gaps else 0.0,
                 lone=statistics.fmean(ratios) if ratios else 1.0)


def predicted_bubble(schedule: Sequence[Sequence[Action]], timelines: Sequence[Timeline], n_stages: int,
                     link: float, lone: Collection[Action] = frozenset()) -> float:
    """Median over steps of the bubble simulated with each step's own :func:`measured_costs`: pooled means
    even out which stage is slowest and predict too small a bubble (docs/performance.md, ``make bench-pp4``)."""
    return statistics.median(simulate(schedule, measured_costs([t], n_stages, link, lone)).bubble_fraction
                             for t in timelines)


@dataclass(frozen=True)
class _Replayed(Costs):
    """Costs whose compute actions take the durations in ``taken`` and whose messages the transfer times in
    ``transfers`` (keyed by SEND), of one recorded step (:func:`replayed_bubble`)."""

    taken: Mapping[Action, float] = field(default_factory=dict)
    transfers: Mapping[Action, float] = field(default_factory=dict)

    def duration(self, action: Action) -> float:
        if action.is_comm:
            send = action if action.kind in SEND_KINDS else action.partner
            return self.transfers.get(send, self.comm)
        return self.taken[action] if action in self.taken else super().duration(action)


def replayed_bubble(schedule: Sequence[Sequence[Action]], costs: Costs, timelines: Sequence[Timeline],
                    link: float | None = None) -> float:
    """Median over steps of the bubble simulated with each action and message taking what it took in that step
    (other costs from ``costs``): keeps the variation mean costs lose, so what remains against the measured
    bubble is waiting the simulator does not model."""
    fields = {**asdict(costs), "lone": 1.0}  # a recorded duration is what the action took, borrowed cores or not
    return statistics.median(
        simulate(schedule, _Replayed(**fields, taken={r.action: r.duration for r in t.records if r.action.is_compute},
                                     transfers=t.transfers(link) if link is not None else {}))
        .bubble_fraction for t in timelines)


def concurrency(schedule: Sequence[Sequence[Action]]) -> dict[Action, int]:
    """How many ranks compute during each compute action with uniform costs (F=1, B=2), so every rank derives
    the same answer before any step: a lone action may borrow idle ranks' cores."""
    n_ranks = len(schedule)
    n_total = n_ranks * (max((a.stage // n_ranks for actions in schedule for a in actions), default=0) + 1)
    timeline = _Run(schedule, Costs(), n_total, blocking=False).timeline()  # also runs forward-only lists
    computing = [r for r in timeline.records if r.action.is_compute]
    return {record.action: 1 + len({other.rank for other in computing if other.rank != record.rank
                                    and other.start < record.end and record.start < other.end})
            for record in computing}


def simulate(schedule: Sequence[Sequence[Action]], costs: Costs = Costs(), *, n_microbatches: int | None = None,
             n_virtual: int | None = None, blocking_comm: bool = False) -> Timeline:
    """Verify ``schedule`` (one action list per rank) under rendezvous sends and time it under ``costs`` (async
    posting, or blocking p2p with ``blocking_comm``); :class:`ScheduleError` names the rank and action that cannot
    run."""
    n_ranks = len(schedule)
    if n_ranks == 0:
        raise ScheduleError("the schedule has no ranks; pass one action list per pipeline rank")
    actions = [a for actions in schedule for a in actions]
    if n_virtual is None:
        n_virtual = max((a.stage // n_ranks for a in actions), default=0) + 1
    if n_microbatches is None:
        n_microbatches = max((a.microbatch for a in actions), default=-1) + 1
    n_total = n_ranks * n_virtual
    _check_placement(schedule, n_total, n_microbatches)
    _check_complete(schedule, n_total, n_microbatches)
    lone = frozenset() if costs.lone == 1.0 else frozenset(a for a, n in concurrency(schedule).items() if n == 1)
    strict = _Run(schedule, costs, n_total, blocking=True, lone=lone).timeline()
    return strict if blocking_comm else _Run(schedule, costs, n_total, blocking=False, lone=lone).timeline()


def _check_placement(schedule: Sequence[Sequence[Action]], n_total: int, n_microbatches: int) -> None:
    n_ranks = len(schedule)
    seen: Counter[Action] = Counter()
    for rank, actions in enumerate(schedule):
        for action in actions:
            if action.stage >= n_total or action.microbatch >= n_microbatches:
                raise ScheduleError(
                    f"{action} on rank {rank} is outside the model "
                    f"({n_total} stages, {n_microbatches} microbatches)"
                )
            if stage_to_rank(action.stage, n_ranks) != rank:
                raise ScheduleError(
                    f"{action} is on rank {rank}, but stage {action.stage} lives on rank "
                    f"{stage_to_rank(action.stage, n_ranks)} (stage % {n_ranks}); move it there"
                )
            seen[action] += 1
            if seen[action] > 1:
                raise ScheduleError(f"duplicated action {action} on rank {rank}: each action must run exactly once")


def _check_complete(schedule: Sequence[Sequence[Action]], n_total: int, n_microbatches: int) -> None:
    """Each (stage, mb) needs one F and one B or one BI+BW, and exactly the messages they imply."""
    n_ranks = len(schedule)
    present = {a for actions in schedule for a in actions}
    for stage in range(n_total):
        rank = stage_to_rank(stage, n_ranks)
        for mb in range(n_microbatches):
            kinds = {k for k in _COMPUTE_ORDER if Action(k, mb, stage) in present}
            split = kinds.intersection(_SPLIT_BACKWARD)
            if ActionKind.B in kinds and split:
                raise ScheduleError(
                    f"stage {stage} microbatch {mb} on rank {rank} has both B and BI/BW; "
                    "keep one backward form"
                )
            wanted = (ActionKind.F, *(_SPLIT_BACKWARD if split else (ActionKind.B,)))
            missing = [k for k in wanted if k not in kinds]
            if missing:
                names = " and ".join(str(Action(k, mb, stage)) for k in missing)
                raise ScheduleError(f"missing action {names} on rank {rank}")
    expected = {
        message: (action, side)
        for action in present
        if action.is_compute
        for pair in required_messages(action, n_ranks, n_total)
        for side, message in enumerate(pair)
    }
    for message, (producer, side) in expected.items():
        if message not in present:
            role = "send its output to" if side == 0 else "receive its input on"
            raise ScheduleError(
                f"missing action {message} on rank {stage_to_rank(message.stage, n_ranks)}: "
                f"{producer} needs it to {role} rank {stage_to_rank(message.peer_stage, n_ranks)}"
            )
    for action in present:
        if action.is_comm and action not in expected:
            raise ScheduleError(
                f"unmatched action {action} on rank {stage_to_rank(action.stage, n_ranks)}: "
                f"no stage {action.peer_stage} on another rank exchanges this tensor "
                "(first/last stage, or both stages on one rank); remove it"
            )


class _Run:
    """Dataflow execution of a placed, complete schedule; a deadlock raises ScheduleError. ``blocking`` makes
    SEND/RECV rendezvous, else data lands ``comm`` after both are posted. Start times are a max over free
    and input times, so stepping order does not matter."""

    def __init__(self, schedule: Sequence[Sequence[Action]], costs: Costs, n_total: int, blocking: bool,
                 lone: Collection[Action] = frozenset()) -> None:
        self.schedule = schedule
        self.lone = lone
        self.costs = costs
        self.n_total = n_total
        self.blocking = blocking
        self.n_ranks = len(schedule)
        self.position = [0] * self.n_ranks
        self.free_at = [0.0] * self.n_ranks
        self.ready: dict[tuple[int, Token], float] = {}
        self.posted: dict[Action, float] = {}
        self.records: list[TimelineRecord] = []

    def timeline(self) -> Timeline:
        progressed = True
        while progressed:
            progressed = False
            for rank in range(self.n_ranks):
                while self._step(rank):
                    progressed = True
        stuck = [rank for rank in range(self.n_ranks) if self._head(rank) is not None]
        if stuck:
            raise ScheduleError("schedule deadlocks: " + "; ".join(self._why_stuck(rank) for rank in stuck))
        return Timeline.from_records(self.records, self.n_ranks)

    def _head(self, rank: int) -> Action | None:
        actions = self.schedule[rank]
        return actions[self.position[rank]] if self.position[rank] < len(actions) else None

    def _inputs_ready_at(self, rank: int, action: Action) -> float | None:
        times = [self.ready.get((rank, token)) for token in action_inputs(action, self.n_total)]
        return None if None in times else max(times, default=0.0)

    def _step(self, rank: int) -> bool:
        action = self._head(rank)
        if action is None:
            return False
        if action.is_compute:
            return self._compute(rank, action)
        if not self.blocking:
            return self._post(rank, action)
        if action.kind in SEND_KINDS:
            return self._rendezvous(rank, action)
        peer = stage_to_rank(action.peer_stage, self.n_ranks)
        send = self._head(peer)
        return send == action.partner and self._rendezvous(peer, send)

    def _compute(self, rank: int, action: Action) -> bool:
        inputs_at = self._inputs_ready_at(rank, action)
        if inputs_at is None:
            return False
        start = max(self.free_at[rank] + self.costs.dispatch, inputs_at)
        end = start + self.costs.duration(action) * (self.costs.lone if action in self.lone else 1.0)
        self._finish(rank, action, start, end)
        self._deliver(rank, action, end)
        return True

    def _rendezvous(self, rank: int, send: Action) -> bool:
        peer = stage_to_rank(send.peer_stage, self.n_ranks)
        recv = send.partner
        inputs_at = self._inputs_ready_at(rank, send)
        if inputs_at is None or self._head(peer) != recv:
            return False
        start = max(self.free_at[rank], self.free_at[peer], inputs_at)
        end = start + self.costs.duration(send) + self.costs.post
        self._finish(rank, send, start, end)
        self._finish(peer, recv, start, end)
        self._deliver(peer, recv, end)
        return True

    def _post(self, rank: int, comm: Action) -> bool:
        """Post an isend/irecv: the rank is busy ``post``. The data moves once both sides are posted (Gloo,
        like any rendezvous protocol, sends only into a posted receive) and reaches the peer ``comm`` after
        the later of the two (or when posting ends, if that is later)."""
        start = self.free_at[rank] + self.costs.dispatch
        if comm.kind in SEND_KINDS:  # it needs its tensor
            inputs_at = self._inputs_ready_at(rank, comm)
            if inputs_at is None:
                return False
            start = max(start, inputs_at)
        self.posted[comm] = start
        send, recv = (comm, comm.partner) if comm.kind in SEND_KINDS else (comm.partner, comm)
        if send in self.posted and recv in self.posted:
            both = max(self.posted[send], self.posted[recv])
            arrival = max(both + self.costs.duration(comm), self.posted[send] + self.costs.post)
            self._deliver(stage_to_rank(recv.stage, self.n_ranks), recv, arrival)
        self._finish(rank, comm, start, start + self.costs.post)
        return True

    def _finish(self, rank: int, action: Action, start: float, end: float) -> None:
        self.records.append(TimelineRecord(rank, action, start, end))
        self.free_at[rank] = end
        self.position[rank] += 1

    def _deliver(self, rank: int, action: Action, at: float) -> None:
        """Make ``action``'s product usable on ``rank`` from time ``at``."""
        output = action_output(action)
        if output is not None:
            self.ready[(rank, output)] = at

    def _why_stuck(self, rank: int) -> str:
        action = self._head(rank)
        missing = [t for t in action_inputs(action, self.n_total) if (rank, t) not in self.ready]
        if missing:
            later = self.schedule[rank][self.position[rank] :]
            producers = ", ".join(str(a) for a in later if action_output(a) in missing)
            return f"rank {rank} is stuck at {action} waiting for {producers}, which comes later in its list"
        peer = stage_to_rank(action.peer_stage, self.n_ranks)
        peer_head = self._head(peer)
        if peer_head == action.partner:
            return f"rank {rank} is stuck at {action}; its partner {peer_head} on rank {peer} cannot run yet"
        at = f"is at {peer_head}" if peer_head is not None else "has finished its list"
        return f"rank {rank} is stuck at {action} until rank {peer} reaches {action.partner}, but it {at}"
