"""Pipeline schedules as data: they verify, hit the textbook bubble and memory numbers, broken ones fail."""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys

import pytest

from trainmesh.pipeline.draw import draw_timeline, schedule_command
from trainmesh.pipeline.schedules import (
    SCHEDULES,
    SEND_KINDS,
    Action,
    ActionKind,
    action_inputs,
    action_output,
    build_schedule,
    hoist_receives,
    rank_stages,
    required_messages,
    stage_to_rank,
)
from trainmesh.pipeline.simulate import (
    Costs,
    ScheduleError,
    Timeline,
    TimelineRecord,
    measured_costs,
    predicted_bubble,
    replayed_bubble,
    simulate,
)

F, B, BI, BW = ActionKind.F, ActionKind.B, ActionKind.BI, ActionKind.BW
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def all_cases():
    """Every valid (name, p, m, v) for p in {1, 2, 4}, m in {1, 2, 4, 8}."""
    for name in SCHEDULES:
        for p in (1, 2, 4):
            for m in (1, 2, 4, 8):
                for v in (1, 2, 3) if name == "interleaved" else (1,):
                    if name != "interleaved" or m % p == 0:
                        yield name, p, m, v


def idle_per_rank(timeline: Timeline) -> float:
    return (timeline.n_ranks * timeline.makespan - sum(timeline.busy_times)) / timeline.n_ranks


def remove(schedule, rank, predicate):
    """Copy of ``schedule`` without the actions of ``rank`` matching ``predicate``."""
    return [[a for a in acts if not (r == rank and predicate(a))] for r, acts in enumerate(schedule)]


# --- data model ------------------------------------------------------------------------------------


def test_action_str_and_peer():
    assert str(Action(F, 3, 1)) == "F3s1"
    assert str(Action(ActionKind.SEND_B, 0, 2)) == "SEND_B0s2"
    assert Action(ActionKind.SEND_F, 3, 1).peer_stage == 2
    assert Action(ActionKind.RECV_F, 3, 2).peer_stage == 1
    assert Action(ActionKind.SEND_B, 3, 2).peer_stage == 1
    assert Action(ActionKind.RECV_B, 3, 1).peer_stage == 2
    with pytest.raises(ValueError, match="compute action"):
        _ = Action(F, 0, 0).peer_stage


def test_action_validates():
    with pytest.raises(TypeError, match="ActionKind"):
        Action("F", 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        Action(F, -1, 0)


def test_stage_ownership_round_robin():
    assert [stage_to_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rank_stages(1, 4, 3) == (1, 5, 9)
    assert rank_stages(0, 1) == (0,)
    with pytest.raises(ValueError, match="outside the pipeline"):
        rank_stages(4, 4)


def test_dependencies_and_messages():
    assert action_inputs(Action(F, 2, 0), 4) == ()
    assert action_inputs(Action(BI, 2, 1), 4) == (("act", 1, 2), ("grad", 2, 2))
    assert action_inputs(Action(B, 2, 3), 4) == (("act", 3, 2),)
    assert action_output(Action(ActionKind.RECV_B, 2, 1)) == ("grad", 2, 2)
    assert required_messages(Action(F, 0, 1), 4, 4) == (
        (Action(ActionKind.SEND_F, 0, 1), Action(ActionKind.RECV_F, 0, 2)),
    )
    assert required_messages(Action(F, 0, 3), 4, 4) == ()  # last stage: loss is local
    assert required_messages(Action(F, 0, 0), 1, 2) == ()  # both stages on rank 0


# --- argument checks -------------------------------------------------------------------------------


def test_registry():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb"}


@pytest.mark.parametrize(
    "name, p, m, v, message",
    [
        ("nope", 2, 4, 1, "unknown pipeline schedule"),
        ("1f1b", 0, 4, 1, "n_stages must be an integer >= 1"),
        ("gpipe", 2, 0, 1, "n_microbatches must be an integer >= 1"),
        ("interleaved", 2, 4, 0, "n_virtual must be an integer >= 1"),
        ("1f1b", 2, 4, 2, "needs the 'interleaved' schedule"),
        ("interleaved", 4, 6, 2, "multiple of n_stages .*Choose m=4 or m=8, or use the '1f1b'"),
        ("interleaved", 4, 2, 2, "Choose m=4, or"),
    ],
)
def test_build_schedule_rejects(name, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(name, p, m, v)


# --- every built-in schedule is valid -------------------------------------------------------------


@pytest.mark.parametrize("name, p, m, v", list(all_cases()))
def test_builtin_schedules_verify(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    assert len(schedule) == p
    for rank, actions in enumerate(schedule):
        assert {a.stage for a in actions} <= set(rank_stages(rank, p, v))
    backward_kinds = (BI, BW) if name == "zb" else (B,)
    n_compute = sum(a.is_compute for acts in schedule for a in acts)
    assert n_compute == p * v * m * (1 + len(backward_kinds))
    if p == 1:
        assert not any(a.is_comm for acts in schedule for a in acts)
    for blocking in (False, True):
        simulate(schedule, n_microbatches=m, n_virtual=v, blocking_comm=blocking)


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb", 4, 8, 1)])
def test_no_deadlock_under_any_costs(name, p, m, v):
    """The comm order is deadlock-free by construction, not only for the costs it was placed with."""
    rng = random.Random(0)
    schedule = build_schedule(name, p, m, v)
    for _ in range(5):

        def per_stage(low, high):
            return tuple(rng.uniform(low, high) for _ in range(p * v))

        costs = Costs(
            forward=per_stage(0.2, 3),
            backward=per_stage(0.2, 6),
            backward_input=per_stage(0.2, 3),
            backward_weight=per_stage(0.2, 3),
            comm=rng.uniform(0, 1),
        )
        blocking = simulate(schedule, costs, blocking_comm=True)
        asynchronous = simulate(schedule, costs)
        assert asynchronous.makespan <= blocking.makespan + 1e-9


# --- bubble formulas -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gpipe_and_1f1b_bubble(name, p, m):
    expected = (p - 1) / (m + p - 1)
    schedule = build_schedule(name, p, m)
    assert simulate(schedule).bubble_fraction == pytest.approx(expected)
    assert simulate(schedule, blocking_comm=True).bubble_fraction == pytest.approx(expected)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("backward", [1.0, 2.0, 3.0])
def test_interleaved_bubble(p, m, v, backward):
    """Per-chunk costs f, b: bubble fraction (p-1)/(v·m + p-1), whatever b/f."""
    timeline = simulate(build_schedule("interleaved", p, m, v), Costs(forward=1.0, backward=backward))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaving_cuts_bubble_time_by_v(p, m, v):
    """Same model, cut into v chunks per rank: the idle time of every rank shrinks v times."""
    plain = simulate(build_schedule("1f1b", p, m))
    chunked = simulate(build_schedule("interleaved", p, m, v), Costs(forward=1 / v, backward=2 / v))
    assert idle_per_rank(plain) == pytest.approx(3 * (p - 1))
    assert idle_per_rank(chunked) == pytest.approx(idle_per_rank(plain) / v)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_zb_h1_bubble(p, m):
    """F = BI = BW = 1: each rank idles p-1, a third of 1F1B's 3(p-1)."""
    timeline = simulate(build_schedule("zb", p, m))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert idle_per_rank(timeline) == pytest.approx(idle_per_rank(simulate(build_schedule("1f1b", p, m))) / 3)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_zb_h1_beats_1f1b_without_more_memory(p, m):
    zb = simulate(build_schedule("zb", p, m))
    one_f_one_b = simulate(build_schedule("1f1b", p, m))
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    assert max(zb.peak_activations) <= max(one_f_one_b.peak_activations)


@pytest.mark.parametrize("t_f, t_bi, t_bw", [(1, 1, 0.5), (1, 0.5, 1), (2, 1, 1), (1, 2, 1), (1, 0.7, 0.3)])
def test_zb_h1_idle_general_costs(t_f, t_bi, t_bw):
    p, m = 4, 8
    costs = Costs(forward=t_f, backward_input=t_bi, backward_weight=t_bw)
    timeline = simulate(build_schedule("zb", p, m), costs)
    assert idle_per_rank(timeline) == pytest.approx((p - 1) * max(t_f, t_bi, t_f + t_bi - t_bw))


def test_single_rank_has_no_bubble():
    for name in SCHEDULES:
        assert simulate(build_schedule(name, 1, 4)).bubble_fraction == 0.0


def test_comm_latency_costs_time():
    schedule = build_schedule("1f1b", 4, 8)
    free = simulate(schedule)
    slow = simulate(schedule, Costs(comm=0.5))
    assert slow.makespan > free.makespan
    assert simulate(schedule, Costs(comm=0.5), blocking_comm=True).makespan >= slow.makespan


def test_a_message_moves_only_once_its_receive_is_posted():
    """Gloo sends only into a posted receive: GPipe's second activation, sent at t=2, reaches stage 1
    ``comm`` after its RECV is posted (t=2.5, after F0s1) unless the receive was hoisted before F0s1."""
    schedule = build_schedule("gpipe", 2, 2)
    assert schedule[1].index(Action(ActionKind.RECV_F, 1, 1)) > schedule[1].index(Action(F, 0, 1))
    costs = Costs(forward=1.0, backward=2.0, comm=0.5)

    def second_forward_start(lists) -> float:
        return next(r.start for r in simulate(lists, costs).records if r.action == Action(F, 1, 1))

    assert second_forward_start(schedule) == pytest.approx(3.0)
    assert second_forward_start([hoist_receives(actions) for actions in schedule]) == pytest.approx(2.5)


def test_lone_actions_borrow_the_idle_cores_and_the_simulator_times_them():
    from trainmesh.pipeline.runtime import lone_actions
    schedule = [hoist_receives(actions) for actions in build_schedule("1f1b", 2, 8)]
    lone = lone_actions(schedule)
    assert lone == {Action(F, 0, 0), Action(B, 0, 1), Action(B, 7, 0)}
    plain = simulate(schedule, Costs())
    fast = simulate(schedule, Costs(lone=0.5))
    durations = {r.action: r.duration for r in fast.records if r.action.is_compute}
    assert all(durations[a] == pytest.approx(0.5 * plain_d) for a, plain_d in
               ((r.action, r.duration) for r in plain.records if r.action in lone))
    assert fast.makespan < plain.makespan
    measured = measured_costs([fast], 2, 0.0, lone)
    assert measured.lone == pytest.approx(0.5)
    assert measured.forward == pytest.approx((1.0, 1.0)) and measured.backward == pytest.approx((2.0, 2.0))
    with pytest.raises(ValueError, match="lone must be > 0"):
        Costs(lone=0.0)


# --- activation memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_peak_activations(p, m):
    assert simulate(build_schedule("gpipe", p, m)).peak_activations == (m,) * p
    one_f_one_b = simulate(build_schedule("1f1b", p, m)).peak_activations
    assert one_f_one_b == tuple(min(p - r, m) for r in range(p))
    assert simulate(build_schedule("zb", p, m)).peak_activations == (min(p, m),) * p


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_interleaved_peak_activations(p, m, v):
    """In chunk activations: warmup (v-1)·p + 2(p-r-1), plus the steady-state forward."""
    peaks = simulate(build_schedule("interleaved", p, m, v)).peak_activations
    assert peaks == tuple(min(m * v, (v - 1) * p + 2 * (p - r - 1) + 1) for r in range(p))


def test_interleaved_with_one_chunk_is_1f1b():
    assert build_schedule("interleaved", 4, 8, 1) == build_schedule("1f1b", 4, 8)


# --- broken schedules are caught -------------------------------------------------------------------


def naive_comm(schedule, n_ranks, n_total):
    """Same compute order, each RECV right before its consumer and each SEND right after its producer."""
    compute = [[a for a in acts if a.is_compute] for acts in schedule]
    recvs = [[] for _ in range(n_ranks)]
    for acts in compute:
        for action in acts:
            for _, recv in required_messages(action, n_ranks, n_total):
                recvs[stage_to_rank(recv.stage, n_ranks)].append(recv)
    naive = []
    for rank, acts in enumerate(compute):
        order = []
        for action in acts:
            order += [r for r in recvs[rank] if action_output(r) in action_inputs(action, n_total)]
            order += [action, *(send for send, _ in required_messages(action, n_ranks, n_total))]
        naive.append(order)
    return naive


def test_naive_comm_order_deadlocks_with_blocking_sends():
    """Rank 0 blocks sending F1 while rank 1 blocks sending B0: why the comm order is planned."""
    naive = naive_comm(build_schedule("1f1b", 2, 4), 2, 2)
    with pytest.raises(
        ScheduleError, match="deadlocks: rank 0 is stuck at SEND_F1s0.*rank 1 is stuck at SEND_B0s1"
    ):
        simulate(naive)


def test_swapped_receives_deadlock():
    schedule = build_schedule("1f1b", 2, 4)
    rank1 = schedule[1]
    first, second = (i for i, a in enumerate(rank1) if a.kind is ActionKind.RECV_F and a.microbatch < 2)
    rank1[first], rank1[second] = rank1[second], rank1[first]
    with pytest.raises(ScheduleError, match="rank 1 is stuck at RECV_F1s1 until rank 0 reaches SEND_F1s0"):
        simulate(schedule)


def test_send_before_its_forward_deadlocks():
    schedule = build_schedule("1f1b", 2, 4)
    schedule[0].remove(Action(ActionKind.SEND_F, 0, 0))
    schedule[0].insert(0, Action(ActionKind.SEND_F, 0, 0))
    with pytest.raises(
        ScheduleError, match="rank 0 is stuck at SEND_F0s0 waiting for F0s0, which comes later"
    ):
        simulate(schedule)


def test_weight_grad_before_input_grad_deadlocks():
    schedule = build_schedule("zb", 2, 4)
    schedule[1].remove(Action(BW, 0, 1))
    schedule[1].insert(0, Action(BW, 0, 1))
    with pytest.raises(ScheduleError, match="stuck at BW0s1 waiting for BI0s1"):
        simulate(schedule)


@pytest.mark.parametrize(
    "name, dropped",
    [
        ("1f1b", Action(F, 2, 1)),
        ("1f1b", Action(B, 3, 0)),
        ("zb", Action(BW, 1, 1)),
        ("1f1b", Action(ActionKind.RECV_F, 2, 1)),
        ("gpipe", Action(ActionKind.SEND_B, 0, 1)),
    ],
)
def test_missing_action(name, dropped):
    schedule = build_schedule(name, 2, 4)
    rank = stage_to_rank(dropped.stage, 2)
    with pytest.raises(ScheduleError, match=f"missing action {dropped} on rank {rank}"):
        simulate(remove(schedule, rank, lambda a: a == dropped))


def test_missing_last_microbatch_needs_explicit_count():
    schedule = remove(build_schedule("1f1b", 2, 4), 0, lambda a: a.microbatch == 3)
    schedule = remove(schedule, 1, lambda a: a.microbatch == 3)
    simulate(schedule)  # looks like a valid m=3 schedule
    with pytest.raises(ScheduleError, match="missing action F3s0"):
        simulate(schedule, n_microbatches=4)


def test_duplicated_action():
    schedule = build_schedule("1f1b", 2, 4)
    schedule[1].append(Action(B, 0, 1))
    with pytest.raises(ScheduleError, match="duplicated action B0s1 on rank 1"):
        simulate(schedule)


def test_action_on_wrong_rank():
    schedule = build_schedule("1f1b", 2, 4)
    schedule[0].append(schedule[1].pop())
    with pytest.raises(ScheduleError, match="is on rank 0, but stage 1 lives on rank 1"):
        simulate(schedule)


def test_unmatched_send():
    schedule = build_schedule("1f1b", 2, 4)
    schedule[1].append(Action(ActionKind.SEND_F, 0, 1))  # the last stage has nobody to send to
    with pytest.raises(ScheduleError, match="unmatched action SEND_F0s1 on rank 1"):
        simulate(schedule)


def test_mixed_backward_forms():
    schedule = build_schedule("1f1b", 2, 4)
    schedule[1].append(Action(BI, 0, 1))
    with pytest.raises(ScheduleError, match="has both B and BI/BW"):
        simulate(schedule)


def test_empty_schedule():
    with pytest.raises(ScheduleError, match="no ranks"):
        simulate([])


# --- costs and timelines ---------------------------------------------------------------------------


def test_costs_validate():
    with pytest.raises(ValueError, match="Costs.forward must be > 0"):
        Costs(forward=0.0)
    with pytest.raises(ValueError, match="Costs.backward_input must be > 0"):
        Costs(backward_input=(1.0, -1.0))
    with pytest.raises(ValueError, match="Costs.comm"):
        Costs(comm=-1.0)
    with pytest.raises(ValueError, match="no entry for stage 1"):
        Costs(forward=(1.0,)).duration(Action(F, 0, 1))
    assert Costs(backward=(2.0, 4.0)).duration(Action(BW, 0, 1)) == 2.0


def test_per_stage_costs():
    timeline = simulate(build_schedule("1f1b", 2, 4), Costs(forward=(1.0, 2.0), backward=(2.0, 4.0)))
    assert timeline.busy_times == (12.0, 24.0)
    assert timeline.makespan >= 24.0 + 1.0  # the slow rank waits at least for the first forward


def test_timeline_from_measured_records():
    """A runtime builds the same Timeline from wall-clock stamps; order and clock offset don't matter."""
    t0 = 1_000.0
    records = [
        TimelineRecord(1, Action(F, 0, 1), t0 + 1, t0 + 2),
        TimelineRecord(0, Action(F, 0, 0), t0 + 0, t0 + 1),
        TimelineRecord(0, Action(ActionKind.SEND_F, 0, 0), t0 + 1, t0 + 1.1),
        TimelineRecord(1, Action(B, 0, 1), t0 + 2, t0 + 4),
        TimelineRecord(0, Action(B, 0, 0), t0 + 4, t0 + 6),
    ]
    timeline = Timeline.from_records(records)
    assert timeline.n_ranks == 2
    assert [r.action for r in timeline.rank_records(0)] == [
        Action(F, 0, 0),
        Action(ActionKind.SEND_F, 0, 0),
        Action(B, 0, 0),
    ]
    assert timeline.makespan == 6.0
    assert timeline.busy_times == (3.0, 3.0)
    assert timeline.bubble_fraction == pytest.approx(0.5)
    assert timeline.peak_activations == (1, 1)


def test_timeline_rejects_bad_records():
    with pytest.raises(ValueError, match="outside 0..0"):
        Timeline((TimelineRecord(1, Action(F, 0, 0), 0.0, 1.0),), 1)
    with pytest.raises(ValueError, match="ends before it starts"):
        Timeline((TimelineRecord(0, Action(F, 0, 0), 1.0, 0.0),), 1)


# --- drawing and the CLI text ----------------------------------------------------------------------


@pytest.mark.parametrize("name, v", [("zb", 1), ("interleaved", 2)])
def test_draw_timeline_png(tmp_path, name, v):
    pytest.importorskip("matplotlib")
    path = draw_timeline(simulate(build_schedule(name, 2, 4, v)), tmp_path / "t.png", title=name)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > len(PNG_SIGNATURE)


def test_draw_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for module in (
        "matplotlib",
        "matplotlib.figure",
        "matplotlib.backends.backend_agg",
        "matplotlib.patches",
    ):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install 'trainmesh\[viz\]'"):
        draw_timeline(simulate(build_schedule("1f1b", 2, 2)), tmp_path / "t.png")


def test_draw_needs_compute(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no compute actions"):
        draw_timeline(Timeline((), 1), tmp_path / "t.png")


def test_schedule_command_text(tmp_path):
    text = schedule_command(4, 8, "1f1b", 1, None)
    assert "bubble fraction 0.2727" in text
    assert "F0s0 F1s0 F2s0 F3s0 B0s0 F4s0" in text
    rank_rows = [line for line in text.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [int(row.split()[3]) for row in rank_rows] == [4, 3, 2, 1]  # peak activations column
    assert not list(tmp_path.iterdir())


def test_schedule_command_draws_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "zb.png"
    text = schedule_command(4, 8, "zb", 1, str(png))
    assert "bubble fraction 0.1111" in text
    assert f"timeline drawn to {png}" in text
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_schedule_command_passes_on_argument_errors():
    with pytest.raises(ValueError, match="multiple of n_stages"):
        schedule_command(4, 6, "interleaved", 2, None)


def test_posting_occupies_the_rank_and_the_transfer_delays_the_consumer():
    """GPipe pp=2 m=1 with F=1, B=2: rank 0's send is posted 1..2 (post 1 > comm 0.5, so the activation
    lands at 2), rank 1 runs F 2..3, B 3..5 and posts its send 5..6; rank 0's B runs 6..8."""
    schedule = [hoist_receives(a) for a in build_schedule("gpipe", 2, 1)]
    timeline = simulate(schedule, Costs(comm=0.5, post=1.0))
    assert timeline.makespan == pytest.approx(8.0)
    assert Costs.transfer(1e-3, 1e9, 10**6) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Costs.transfer(1e-3, 0.0, 10)


def test_measured_costs_recover_the_costs_of_a_timeline_and_round_trip(tmp_path):
    costs = Costs(forward=(1.0, 2.0), backward_input=(1.5, 3.0), backward_weight=(0.5, 1.0), comm=0.25, post=0.125,
                  dispatch=0.0625)
    timeline = simulate([hoist_receives(a) for a in build_schedule("zb", 2, 8)], costs)
    measured = measured_costs([timeline, timeline], 2, comm=0.25)
    assert measured == Costs(forward=(1.0, 2.0), backward=(2.0, 4.0), backward_input=(1.5, 3.0),
                             backward_weight=(0.5, 1.0), comm=0.25, post=0.125, dispatch=0.0625)
    assert Costs.load(measured.save(tmp_path / "costs.json")) == measured
    (tmp_path / "bad.json").write_text("{\"forwards\": 1}")
    with pytest.raises(ValueError, match="trainmesh train --timeline"):
        Costs.load(tmp_path / "bad.json")


def test_replaying_recorded_durations_reproduces_each_steps_bubble_which_mean_costs_underestimate():
    """Steps whose actions vary around their mean (as measured on a shared CPU) idle longer than a step of
    mean durations: the replay reproduces each recorded step's bubble exactly, the mean costs fall short."""
    schedule = [hoist_receives(a) for a in build_schedule("1f1b", 2, 8)]
    base = Costs(forward=1.0, backward=2.0, comm=0.05, post=0.01, dispatch=0.02)
    rng = random.Random(0)

    class Varied(Costs):
        def duration(self, action: Action) -> float:
            return base.duration(action) * (1.0 if action.is_comm else rng.uniform(0.7, 1.3))

    steps = [simulate(schedule, Varied(comm=0.05, post=0.01, dispatch=0.02)) for _ in range(5)]
    costs = measured_costs(steps, 2, comm=0.05)
    assert replayed_bubble(schedule, costs, steps[:1]) == pytest.approx(steps[0].bubble_fraction, abs=1e-12)
    measured = sorted(t.bubble_fraction for t in steps)[2]
    assert replayed_bubble(schedule, costs, steps) == pytest.approx(measured, abs=1e-12)
    assert simulate(schedule, costs).bubble_fraction < measured - 0.01


def test_each_steps_own_costs_predict_a_bubble_that_pooled_costs_underestimate_when_the_slow_stage_moves():
    """Two steps of GPipe pp=2 whose slow stage swaps (a shared host preempting one rank, then the other):
    each step's own means reproduce its bubble, so their median is the measured one; pooled over the two
    steps the stages look balanced and the simulated bubble falls short."""
    schedule = [hoist_receives(a) for a in build_schedule("gpipe", 2, 8)]
    steps = [simulate(schedule, Costs(forward=f, backward=tuple(2 * x for x in f), comm=0.05, post=0.01))
             for f in ((1.0, 1.5), (1.5, 1.0), (1.0, 1.5))]
    measured = statistics.median(t.bubble_fraction for t in steps)
    assert predicted_bubble(schedule, steps, 2, link=0.05) == pytest.approx(measured, abs=1e-12)
    pooled = simulate(schedule, measured_costs(steps[:2], 2, comm=0.05)).bubble_fraction
    assert pooled < predicted_bubble(schedule, steps[:2], 2, link=0.05) - 0.05


def test_messages_take_their_measured_time_in_the_replay_and_their_mean_in_the_costs():
    """A step whose messages each take their own time (a send waiting for a busy host's core) is replayed
    exactly once the timeline records when each send left; its mean is the costs' ``comm``; the idle link's
    time alone predicts a shorter step."""
    schedule = [hoist_receives(a) for a in build_schedule("interleaved", 2, 8, 2)]
    rng = random.Random(1)
    took = {a: rng.uniform(0.1, 0.6) for acts in schedule for a in acts if a.kind in SEND_KINDS}

    class Messages(Costs):
        def duration(self, action: Action) -> float:
            if not action.is_comm:
                return super().duration(action)
            return took[action if action.kind in SEND_KINDS else action.partner]

    step = simulate(schedule, Messages(post=0.01, dispatch=0.02))
    link = 0.05
    posted = {r.action: r.start for r in step.records if r.action.is_comm}
    sent = {send: max(posted[send], posted[send.partner]) + t - link for send, t in took.items()}
    recorded = Timeline.from_records(step.records, 2, sent)
    assert recorded.transfers(link) == pytest.approx(took)
    costs = measured_costs([recorded], 4, comm=link)
    assert costs.comm == pytest.approx(sum(took.values()) / len(took))
    assert replayed_bubble(schedule, costs, [recorded], link=link) == pytest.approx(step.bubble_fraction, abs=1e-12)
    assert replayed_bubble(schedule, dataclasses.replace(costs, comm=link), [recorded]) < step.bubble_fraction - 0.01
    late = Timeline.from_records(step.records, 2, {send: posted[send] - 1.0 for send in took})
    assert set(late.transfers(link).values()) == {link}, "a send that left before its receive was posted"
