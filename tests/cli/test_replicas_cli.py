"""``trainmesh train --lighthouse``: each run one torchft replica group (docs/multinode.md). Two groups trained side
by side average every step over both and end on the same parameters (their held-out losses agree) while each
reads batches of its own; bad combinations are refused in one line before any rank starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")
from trainmesh.replicas import lighthouse  # noqa: E402 - needs torchft

TRAIN = ["train", "--nproc", "2", "--dp", "2", "--zero", "2", "--model", "tiny", "--steps", "4", "--global-batch", "4",
         "--eval-every", "0"]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainmesh", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


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
