"""Async checkpoints (``tm.save(..., async_=True)``, ``--checkpoint-async``): the files are the synchronous
save's, byte for byte, even while training overwrites the state being written; ``latest`` moves only once
every rank's part is durable, so a rank killed during the background write leaves the previous checkpoint
as ``latest`` and loadable."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import trainmesh as tm
from trainmesh.checkpoint import async_save, candidates, read_tensors, store
from trainmesh.distributed.mesh import world_from_env
from trainmesh.models.gpt import GPT, PRESETS
from trainmesh.distributed.testing import RankFailure, run_ranks

from helpers import child_pids

RUN_ID = "0123456789abcdef0123456789abcdef"  # one run id, so two saves of one state write the same manifest


COLLECTIVE_TIMEOUT_S = 120.0
"""What bounds a rank's wait for another: a failure relayed through the store must end the save long before."""


def _model():
    tiny = PRESETS["tiny"]
    mesh = tm.init_mesh(dp=2, timeout=COLLECTIVE_TIMEOUT_S)
    pm = tm.parallelize(GPT(tiny, seed=0), mesh, zero=2)
    opt = tm.optimizer(pm, lr=1e-2)
    x = torch.randint(0, tiny.vocab_size, (4, tiny.seq_len), generator=torch.Generator().manual_seed(0))
    return pm, opt, (x, x.roll(-1, 1))


def _sync_then_async(root: str) -> dict:
    """Save the same state synchronously and asynchronously; train a step while the async one is written."""
    torch.set_num_threads(1)
    os.environ[store.RUN_ID_ENV] = RUN_ID
    pm, opt, batch = _model()
    tm.train_step(pm, opt, batch)
    tm.save(pm, opt, Path(root) / "sync", 1)
    handle = tm.save(pm, opt, Path(root) / "async", 1, async_=True)
    tm.train_step(pm, opt, batch)
    handle.wait()
    return {"stall_s": handle.stall_s, "write_s": handle.write_s}


def test_an_async_save_writes_the_synchronous_files_byte_for_byte(tmp_path):
    times = run_ranks(_sync_then_async, 2, str(tmp_path), timeout=200)
    sync, later = tmp_path / "sync" / "step-00000001", tmp_path / "async" / "step-00000001"
    names = sorted(p.name for p in sync.iterdir())
    assert names == sorted(p.name for p in later.iterdir()) == ["manifest.json", "rank-00000.safetensors",
                                                                 "rank-00001.safetensors"]
    for name in names:
        assert (sync / name).read_bytes() == (later / name).read_bytes(), name
    assert (tmp_path / "async" / "latest").read_text() == "step-00000001\n"
    assert all(t["stall_s"] > 0 and t["write_s"] > 0 for t in times)


def _saved_step_1_and_trained_on(root: str) -> tuple:
    """A model saved at step 1 in the background and trained one step further, ready for the save under test."""
    torch.set_num_threads(1)
    pm, opt, batch = _model()
    tm.train_step(pm, opt, batch)
    tm.save(pm, opt, root, 1, async_=True).wait()
    tm.train_step(pm, opt, batch)
    return pm, opt, batch


def _killed_while_writing(root: str) -> None:
    """Save step 1 and wait; save step 2 in the background, where rank 1 dies by SIGKILL before its file is
    written (rank 0 has written its own and waits for rank 1's)."""
    pm, opt, batch = _saved_step_1_and_trained_on(root)
    if world_from_env()[0] == 1:
        store._write_rank_file = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
    tm.save(pm, opt, root, 2, async_=True).wait()


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint_latest(tmp_path):
    with pytest.raises(RankFailure, match="rank 1"):
        run_ranks(_killed_while_writing, 2, str(tmp_path), timeout=200)
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert candidates(tmp_path)[0].name == "step-00000001"
    assert not (tmp_path / "step-00000002").exists()
    assert "model/head.weight" in read_tensors(tmp_path / "step-00000001", "model/")


def _no_room_for_the_marker(root: str) -> dict:
    """Save step 1; save step 2 in the background, where rank 1's disk fills after its shard, so that its
    done-marker cannot be written (as with ENOSPC): how long until the save failed, and the message."""
    pm, opt, batch = _saved_step_1_and_trained_on(root)
    if world_from_env()[0] == 1:
        real = async_save.write_durably

        def full(path, data, *args):
            if path.name.startswith(".written-"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(path, data, *args)
        async_save.write_durably = full
    start = time.monotonic()
    handle = tm.save(pm, opt, root, 2, async_=True)
    try:
        handle.wait()
    except store.CheckpointError as e:
        return {"message": str(e), "seconds": time.monotonic() - start}
    return {"message": "", "seconds": time.monotonic() - start}


def test_a_rank_that_cannot_write_its_marker_fails_the_async_save_at_once_on_every_rank(tmp_path):
    """Case 5: rank 1's disk is full when it would leave its done-marker. Rank 0 learns it through the store
    at once, not at the collective timeout; every rank fails the save in one line naming rank 1, the file and
    the errno, and step 1 stays ``latest``."""
    outcomes = run_ranks(_no_room_for_the_marker, 2, str(tmp_path), timeout=200)
    marker = tmp_path / ".tmp-step-00000002" / ".written-rank-00001.json"
    for outcome in outcomes:
        message = outcome["message"]
        assert "\n" not in message and outcome["seconds"] < COLLECTIVE_TIMEOUT_S, outcome
        assert f"rank 1: OSError: [Errno {errno.ENOSPC}] No space left on device: '{marker}'" in message, message
        assert "the previous checkpoint (step-00000001) is untouched" in message, message
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert not (tmp_path / "step-00000002").exists()


# Loaded by every process of the job through PYTHONPATH: each rank's background write of step 2 finishes its
# file and says so in a mark file; rank 1 then sleeps before its marker, so the launcher is killed while
# rank 0 waits for rank 1 (a save that published without every rank's part would move ``latest``).
SLOW_WRITE = '''
import os, time
from pathlib import Path
if os.environ.get("RANK") is not None:
    from trainmesh.checkpoint import store
    real = store._write_rank_file
    def slow(path, pieces):
        record = real(path, pieces)
        if path.parent.name == ".tmp-step-00000002":
            (Path(os.environ["SLOW_WRITE_MARKS"]) / f"rank{os.environ['RANK']}").touch()
            time.sleep(120 if os.environ["RANK"] == "1" else 0)
        return record
    store._write_rank_file = slow
'''


def _train(out: Path, ckpt: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "trainmesh", "train", "--nproc", "2", "--dp", "2", "--zero", "2", "--steps", "3",
            "--checkpoint-every", "1", "--checkpoint-async", "--checkpoint-dir", str(ckpt), "--out", str(out),
            "--no-progress", *extra]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow  # a rank killed during the background write stays in the default set (above)
@pytest.mark.timeout(240)
def test_the_launcher_killed_during_the_background_write_leaves_the_previous_checkpoint_latest(tmp_path):
    """``kill -9`` of ``trainmesh train``'s launcher while step 2 is written in the background: its ranks die
    with it, step 1 stays ``latest`` and loadable, and ``--resume`` finishes the run from it."""
    hooks, marks, ckpt = tmp_path / "hooks", tmp_path / "marks", tmp_path / "ckpt"
    hooks.mkdir(), marks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_WRITE)
    path = os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])
    job = _train(tmp_path / "run", ckpt, env={"PYTHONPATH": path, "SLOW_WRITE_MARKS": str(marks)})
    deadline = time.monotonic() + 150
    while len(list(marks.iterdir())) < 2:
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()[-3000:] if job.poll() else "slow"
        time.sleep(0.1)
    ranks = child_pids(job.pid)
    job.kill()
    job.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "a rank outlived its launcher"
    assert (ckpt / "latest").read_text() == "step-00000001\n"
    assert candidates(ckpt)[0].name == "step-00000001"
    assert "model/head.weight" in read_tensors(ckpt / "step-00000001", "model/")
    resumed = _train(tmp_path / "run", ckpt, "--resume")
    _, err = resumed.communicate(timeout=150)
    assert resumed.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[1]["restart"]["from_step"] == 1
    assert (ckpt / "latest").read_text() == "step-00000003\n"
    saves = json.loads((tmp_path / "run" / "summary.json").read_text())["checkpoint_saves"]
    assert [s["step"] for s in saves] == [2, 3]
    assert all(s["stall_s"] > 0 and s["waited_s"] >= 0 and s["write_s"] > 0 for s in saves), saves

