"""What the replica groups need without a job: the core imports without torchft and says how to install it, and the
bench's figures read a survivor's attempts as stated (kill to next trained step, steps given up)."""

import sys

import pytest

from trainmesh_bench.replicas import figures


def test_without_torchft_the_replica_groups_name_the_extra(monkeypatch):
    import trainmesh.replicas as replicas  # imports without torchft: it is imported on first use

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"pip install 'trainmesh\[ft\]'"):
        replicas._torchft()


def test_figures_count_the_survivors_time_from_the_kill_and_the_attempts_it_gave_up():
    both = [{"step": s, "end": 10.0 + s, "participants": 2, "committed": True} for s in range(4)]  # 1 s a step
    failed = {"step": 4, "end": 13.4, "participants": 2, "committed": False}  # the step in flight at the kill
    alone = [{"step": s, "end": 13.9 + 0.5 * (s - 4), "participants": 1, "committed": True} for s in range(4, 8)]
    r = figures(both + [failed] + alone, killed_at=13.2)
    assert r["step_s"] == pytest.approx(1.0) and r["alone_step_s"] == pytest.approx(0.5)
    assert r["kill_to_step_s"] == pytest.approx(0.7) and r["lost_s"] == pytest.approx(0.2)
    assert r["steps_lost"] == 1
