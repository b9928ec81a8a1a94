"""Restart from memory (``train --memory-snapshot``): a run killed after step 4 resumes at step 4 from the
snapshots its ranks kept in host memory, each rank's also in a peer's copy; a shrunk world reshards from them,
a corrupted copy is refused for the other, and with both copies of a rank gone the run says so in one line and
resumes from disk. Every step's loss is one process's, in float64."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FP64_ATOL
from runs import config, in_fp64, train_single

KILLED_AT = 4  # loop index: rank 1 dies after 4 steps, each snapshotted
STEPS = 6


def _train(tmp_path: Path, nproc: int, *extra: str, env: dict[str, str] | None = None,
           torchrun: bool = False) -> subprocess.CompletedProcess:
    """``trainmesh train`` on ``nproc`` ranks, started by trainmesh's launcher (which removes the run's snapshots
    when it ends, failed or not) or by torchrun (which leaves them, as a job of many nodes would keep them)."""
    start = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "trainmesh", "train"] \
        if torchrun else ["-m", "trainmesh", "train", "--nproc", str(nproc)]
    argv = [sys.executable, *start, "--dp", str(nproc), "--steps",
            str(STEPS), "--global-batch", "8", "--warmup-steps", "2", "--precision", "fp64", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--memory-snapshot", "every-step", "--resume",
            "--no-progress", "--out", str(tmp_path / "run"), *extra]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TRAINMESH_FAULT")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=240,
                          env={**base, "OMP_NUM_THREADS": "1", "TRAINMESH_SNAPSHOT_DIR": str(tmp_path / "shm"),
                               **(env or {})})


def _killed_run(tmp_path: Path, nproc: int) -> dict[str, Path]:
    """A run of ``nproc`` ranks under torchrun whose rank 1 is killed after step 4; the snapshot files it left (the two newest
    of each rank, its own and its peer's copy), by name without the run's id."""
    result = _train(tmp_path, nproc, env={"TRAINMESH_FAULT": f"kill@1:{KILLED_AT}"}, torchrun=True)
    assert result.returncode != 0, result.stderr
    files = {p.name.split("-", 2)[2]: p for p in (tmp_path / "shm").iterdir()}
    assert sorted(files) == sorted(f"rank{r:05d}-step{s:08d}.{kind}" for r in range(nproc) for kind in ("own", "peer")
                                   for s in (KILLED_AT - 1, KILLED_AT)), files
    return files


def _drop(files: dict[str, Path], rank: int, kind: str) -> None:
    """Every copy of ``kind`` of ``rank``'s snapshots is gone."""
    for name, path in files.items():
        if name.startswith(f"rank{rank:05d}-") and name.endswith(kind):
            path.unlink()


def _resumed_like_one_process(tmp_path: Path, nproc: int, first_nproc: int) -> str:
    """Resume on ``nproc`` ranks and finish; every logged step's loss is one process's. Returns stderr."""
    result = _train(tmp_path, nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    reference, _ = train_single(in_fp64(config(dp=first_nproc, steps=STEPS, global_batch=8)))
    for r in records:
        assert abs(r["loss"] - reference[r["step"] - 1]) <= FP64_ATOL, f"step {r['step']}"
    assert list((tmp_path / "shm").iterdir()) == [], "a clean end leaves no snapshot behind"
    return result.stderr


@pytest.mark.timeout(500)
def test_a_restart_loads_the_peers_copies_refusing_a_corrupted_one(tmp_path):
    files = _killed_run(tmp_path, 2)
    _drop(files, 1, "own")  # rank 1's memory is gone: its peer's copies remain
    newest = files[f"rank00000-step{KILLED_AT:08d}.own"]
    blob = bytearray(newest.read_bytes())
    blob[-1] ^= 0xFF
    newest.write_bytes(bytes(blob))
    err = _resumed_like_one_process(tmp_path, 2, 2)
    assert f"{newest} does not match its SHA-256 (corrupted); not used, the other copy is tried" in err, err
    assert f"resumed from memory snapshots (step {KILLED_AT}) in " in err, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[KILLED_AT]["restart"]["from_step"] == KILLED_AT


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_with_both_copies_of_a_rank_gone_it_resumes_from_disk_and_says_so(tmp_path):
    files = _killed_run(tmp_path, 2)
    _drop(files, 1, "own")
    _drop(files, 1, "peer")
    err = _resumed_like_one_process(tmp_path, 2, 2)
    lines = [line for line in err.splitlines() if "memory snapshot of run" in line]
    assert len(lines) == 1 and "both copies of a rank's state are gone); resuming from disk" in lines[0], err
    assert f"step-{KILLED_AT:08d} (step {KILLED_AT})" in err, err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_world_shrunk_from_four_ranks_to_two_reshards_from_memory(tmp_path):
    files = _killed_run(tmp_path, 4)
    for r in (2, 3):  # their own copies are gone; the peers' (ranks 3 and 0) remain
        _drop(files, r, "own")
    err = _resumed_like_one_process(tmp_path, 2, 4)
    assert f"resumed from memory snapshots (step {KILLED_AT}) in " in err, err


@pytest.mark.timeout(300)
def test_a_failed_job_leaves_no_snapshot_behind(tmp_path):
    result = _train(tmp_path, 2, env={"TRAINMESH_FAULT": f"kill@1:{KILLED_AT}"})
    assert result.returncode != 0 and "SIGKILL" in result.stderr, result.stderr[-3000:]
    assert list((tmp_path / "shm").iterdir()) == []


@pytest.mark.timeout(60)
def test_memory_snapshots_without_a_restart_to_read_them_are_refused_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--memory-snapshot", "every-step",
                             "--steps", "1", "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].endswith(
        "keeps state for a restart to resume from; add --resume --checkpoint-dir DIR (or --max-restarts N)"), result.stderr


@pytest.mark.timeout(120)
def test_one_process_keeps_its_own_snapshot_and_ends_without_any(tmp_path):
    result = _train(tmp_path, 1, "--steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "memory snapshots: " in result.stderr and list((tmp_path / "shm").iterdir()) == []
