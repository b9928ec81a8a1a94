"""``trainmesh train --lighthouse``: each run one torchft replica group (docs/multinode.md). Two groups trained side
by side average every step over both and end on the same parameters (their held-out losses agree) while each
reads batches of its own; bad combinations are refused in one line before any rank starts."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")
from trainmesh.replicas import lighthouse  # noqa: E402 - needs torchft

TRAIN = ["train", "--nproc", "2", "--dp", "2", "--zero", "2", "--model", "tiny", "--steps", "4", "--global-batch", "4",
         "--eval-every", "0"]


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainmesh", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


@pytest.mark.slow  # tests/multirank/test_replicas.py keeps a kill and heal in the default set
def test_two_replica_groups_train_each_step_together_and_end_alike(tmp_path):
    server = lighthouse(min_replicas=2)  # both in every quorum: neither starts alone
    try:
        procs = [_start(*TRAIN, "--lighthouse", server.address(), "--replica-group", str(k), "--out",
                        str(tmp_path / str(k))) for k in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        server.shutdown()
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    runs = [_records(tmp_path / str(k)) for k in range(2)]
    for records in runs:
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert all(r["replica_groups"] == 2 for r in records)
    assert runs[0][0]["loss"] != runs[1][0]["loss"], "each group reads batches of its own"
    assert runs[0][-1]["val_loss"] == runs[1][-1]["val_loss"], "both groups end on the same parameters"


@pytest.mark.parametrize("flags, message", [
    (["--replica-group", "1"], "--replica-group names a torchft replica group"),
    (["--lighthouse", "http://127.0.0.1:1", "--dp-replicate", "2"], "drop --dp-replicate"),
    (["--lighthouse", "http://127.0.0.1:1", "--max-restarts", "1", "--checkpoint-dir", "ck"], "drop --elastic and"),
])
def test_replica_group_refusals_name_the_fix(flags, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainmesh", *TRAIN, *flags, "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_killed_group_started_again_heals_while_the_other_trains_on(tmp_path):
    """Group 1 is killed in its first step; group 0 trains on alone; group 1 started again with the same command
    heals from it (its first step is past the kill) and both then average over two groups. The runs are long, so
    group 0 outlives the restart whatever this host's speed; the test ends them once group 1 has trained 3 steps."""
    server = lighthouse(min_replicas=1, heartbeat_timeout_s=0.5, join_timeout_s=0.2)
    long = [*TRAIN[:TRAIN.index("--steps") + 1], "100000", *TRAIN[TRAIN.index("--steps") + 2:],
            "--lighthouse", server.address()]
    group = lambda k, out, env=None: _start(*long, "--replica-group", str(k), "--out", str(tmp_path / out), env=env)
    survivor = group(0, "0")
    restarted = None
    try:
        killed = group(1, "1a", {"TRAINMESH_FAULT": "kill@0:*"})
        assert killed.wait(timeout=240) != 0, killed.communicate()[1][-2000:]
        restarted = group(1, "1b")
        deadline = time.monotonic() + 240
        while len(_records(tmp_path / "1b")) < 3:
            assert restarted.poll() is None and survivor.poll() is None, "a group ended early"
            assert time.monotonic() < deadline, "the restarted group did not train 3 steps in 240 s"
            time.sleep(0.2)
    finally:
        for proc in (survivor, restarted):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=30)
        server.shutdown()
    alone, back = _records(tmp_path / "0"), _records(tmp_path / "1b")
    assert [r["replica_groups"] for r in alone] == sorted(r["replica_groups"] for r in alone), "1s, then 2s"
    assert alone[0]["replica_groups"] == 1 and back[0]["step"] > 1, (alone[:3], back[:3])
    assert all(r["replica_groups"] == 2 for r in back)
    together = {r["step"] for r in back[:-1]}  # the last may still be in flight on group 0
    assert together <= {r["step"] for r in alone}, "both groups trained the same steps"
