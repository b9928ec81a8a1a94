"""The peer watchdog's rule (:func:`trainmesh.distributed.heartbeat.lost_peer`), on heartbeat values read at chosen
times: a beat that stops changing is a dead or frozen rank, a beat whose progress stands still while this rank
waits on it is a stuck one, and a waiting peer, a stopped one (the launcher's grace) or one that finished is
never declared."""

from trainmesh.distributed.heartbeat import DONE, PROGRESS, _beat_value, lost_peer, stepping, waiting


def beat(t: float, count: int, waits: bool, host: str = "n1") -> str:
    return f"{t!r} {count} {int(waits)} {host}"


def test_a_heartbeat_that_stops_changing_names_the_rank_and_its_host_after_the_timeout():
    peers = {}
    assert lost_peer(peers, {1: beat(0.0, 5, False)}, set(), 0.0, 10.0, None) is None
    assert lost_peer(peers, {1: beat(0.0, 5, False)}, set(), 9.0, 10.0, None) is None
    line = lost_peer(peers, {1: beat(0.0, 5, False)}, set(), 10.5, 10.0, None)
    assert line.startswith("rank 1 on n1 sent no heartbeat for 10.5 s (--peer-timeout 10)")


def test_a_beating_rank_without_progress_is_stuck_only_while_this_rank_waits_on_it():
    peers = {}
    for t in range(0, 12):
        line = lost_peer(peers, {1: beat(float(t), 5, False)}, set(), float(t), 10.0, None)
        assert line is None, "not waiting here: a long compute is no fault"
    line = lost_peer(peers, {1: beat(12.0, 5, False)}, set(), 12.0, 10.0, 11.0)
    assert line.startswith("rank 1 on n1 is alive but has made no progress for 12.0 s while this rank waited 11.0 s")


def test_progress_a_waiting_peer_a_stopped_one_and_a_finished_one_are_not_declared():
    moving, waits, stopped, done = {}, {}, {}, {}
    for t in range(0, 30):
        now = float(t)
        assert lost_peer(moving, {1: beat(now, t, False)}, set(), now, 10.0, now) is None
        assert lost_peer(waits, {2: beat(now, 5, True)}, set(), now, 10.0, now) is None
        assert lost_peer(stopped, {3: beat(0.0, 5, False)}, {3}, now, 10.0, now) is None
        assert lost_peer(done, {4: DONE}, set(), now, 10.0, now) is None


def test_waiting_counts_nested_waits_once_as_progress_and_time():
    before = PROGRESS.count
    with waiting():
        with waiting():
            assert PROGRESS.waiting_since is not None
    assert PROGRESS.waiting_since is None and PROGRESS.count == before + 1


def test_a_rank_counts_as_stuck_only_inside_a_step_and_outside_a_wait():
    """Building, loading, saving and evaluating may keep one rank busy while its peers wait: excused."""
    assert _beat_value().split()[2] == "1"
    with stepping():
        assert _beat_value().split()[2] == "0"
        with waiting():
            assert _beat_value().split()[2] == "1"
    assert _beat_value().split()[2] == "1"
