"""Restart from memory on the namespace test bed: two nodes of two ranks under ``trainmesh launch --nnodes 1:2``
with ``--memory-snapshot every-step``; node 1 is killed with its memory (its snapshot directory), and node 0's
ranks restart as a world of two from the copies node 0 holds (their own and node 1's ranks' peer copies),
losing at most the step in flight. Every step's loss, before and after, is one process's, in float64."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmesh.distributed.testbed import TestBed, missing_capability

from helpers import FP64_ATOL
from runs import config, in_fp64, train_single

PORT = 29671
STEPS = 10


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_node_restarts_from_the_survivors_memory_losing_at_most_one_step(tmp_path):
    reason = missing_capability()
    if reason:
        pytest.skip(reason)
    out, memory = tmp_path / "run", [Path(f"/dev/shm/trainmesh-test-{os.getpid()}-node{k}") for k in range(2)]
    train = ["train", "--dp", "4", "--steps", str(STEPS), "--global-batch", "8", "--warmup-steps", "2",
             "--precision", "fp64", "--checkpoint-every", "4", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
             "--memory-snapshot", "every-step", "--no-progress", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAINMESH_FAULT")}
    try:
        with TestBed(2, rate_mbit=200) as bed:
            argv = [sys.executable, "-m", "trainmesh", "launch", "--nnodes", "1:2", "--nproc-per-node", "2",
                    "--rdzv-endpoint", f"{bed.members[0].addr}:{PORT}", "--rdzv-id", "memory", "--rdzv-conf",
                    "join_timeout=120,last_call_timeout=5", *train]
            logs = [tmp_path / f"node{k}.log" for k in range(2)]
            procs = [bed.start(k, argv, env={**env, "OMP_NUM_THREADS": "1", "TRAINMESH_SNAPSHOT_DIR": str(memory[k])},
                               stdout=subprocess.DEVNULL, stderr=logs[k].open("w")) for k in range(2)]
            deadline = time.monotonic() + 300
            while not any(r["step"] >= 5 for r in _records(out / "metrics.jsonl")):
                assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
                time.sleep(0.1)
            bed.kill_node(1)
            shutil.rmtree(memory[1], ignore_errors=True)
            done = max(r["step"] for r in _records(out / "metrics.jsonl"))
            assert procs[0].wait(timeout=400) == 0, logs[0].read_text()[-4000:]
        assert list(memory[0].iterdir()) == [], "a clean end leaves no snapshot behind"
    finally:
        for path in memory:
            shutil.rmtree(path, ignore_errors=True)
    log = logs[0].read_text()
    records = _records(out / "metrics.jsonl")
    restart = [r for r in records if r.get("restart", {}).get("from_step", 0) > 0]
    assert restart and restart[-1]["layout"]["dp"] == 2, log[-3000:]
    assert "resumed from memory snapshots" in log and done - restart[-1]["restart"]["from_step"] <= 1, log[-3000:]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    reference, _ = train_single(in_fp64(config(dp=4, steps=STEPS, global_batch=8)))
    for r in records:
        assert abs(r["loss"] - reference[r["step"] - 1]) <= FP64_ATOL, f"step {r['step']}"
