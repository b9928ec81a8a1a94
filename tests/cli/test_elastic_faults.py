"""Faults on one host, each ending as stated and never in a hang: two ``trainmesh launch --nnodes 1:2`` "nodes"
lose one (killed whole, its agent alone, the one hosting the rendezvous store) or have a rank frozen (SIGSTOP)
or stuck (a loop that calls no collective); a rank is slowed (a straggler). Where the run goes on, every
step's loss is one process's in float64 (docs/multinode.md, docs/reliability.md)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmesh.distributed.heartbeat import PEER_LOST_EXIT

from helpers import FP64_ATOL
from runs import config, in_fp64, train_single

TRAIN = ["--dp", "2", "--steps", "8", "--global-batch", "8", "--warmup-steps", "2", "--precision", "fp64",
         "--checkpoint-every", "2", "--resume", "--no-progress", "--peer-timeout", "3"]
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(what: str, ready, procs: list[subprocess.Popen], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), f"{what} never happened"
        time.sleep(0.1)


class Nodes:
    """Two elastic agents on this host; ``store`` (started first, hosting the rendezvous) and ``other``."""

    def __init__(self, tmp_path: Path, fault: str = "") -> None:
        self.ckpt, self.out, port = tmp_path / "ckpt", tmp_path / "run", _free_port()
        argv = [sys.executable, "-m", "trainmesh", "launch", "--nnodes", "1:2", "--nproc-per-node", "1",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "faults", "--rdzv-conf", RDZV_CONF,
                "train", *TRAIN, "--checkpoint-dir", str(self.ckpt), "--out", str(self.out)]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env = {**env, "OMP_NUM_THREADS": "1", **({"TRAINMESH_FAULT": fault} if fault else {})}
        self.logs = [tmp_path / "store.log", tmp_path / "other.log"]
        self.procs: list[subprocess.Popen] = []
        for log in self.logs:
            self.procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                               start_new_session=True))
            _wait("the rendezvous store listening", lambda: _listening(port), self.procs)

    def saved(self, step: int) -> None:
        _wait(f"step {step}'s checkpoint", (self.ckpt / f"step-{step:08d}").exists, self.procs)

    def ranks(self, node: int) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(self.procs[node].pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in found.split()]

    def end(self, procs: list[subprocess.Popen], seconds: float = 150) -> list[str]:
        """Every agent in ``procs`` ended within ``seconds`` (a hang fails the test); their logs."""
        try:
            for p in procs:
                p.wait(timeout=seconds)
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        return [log.read_text() for log in self.logs]


def _trained_like_one_process(out: Path) -> dict:
    """Steps 1 to 8 recorded once each, with one process's float64 losses; the restart's record."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    reference, _ = train_single(in_fp64(config(dp=2, steps=8, global_batch=8, nproc=2)))
    for r in records:
        assert abs(r["loss"] - reference[r["step"] - 1]) <= FP64_ATOL, f"step {r['step']}"
    return next(r for r in records if r.get("restart", {}).get("from_step", 0) > 0)


@pytest.mark.timeout(300)  # 20-25 s (50-70 s on a loaded host): two rendezvous rounds, three rank start-ups
@pytest.mark.slow  # 15 s each quiet; the store host's loss and the stuck rank keep the default set's watch
@pytest.mark.parametrize("what", ["node", "agent"])
def test_losing_the_node_without_the_store_restarts_on_the_survivor_like_one_process(tmp_path, what):
    """The node not hosting the store is killed whole, or its agent alone (its rank dies with it: a rank left
    training without its agent kept the survivor's agent waiting 5 minutes, saying nothing)."""
    nodes = Nodes(tmp_path)
    nodes.saved(4)
    victims = [nodes.procs[1].pid, *(nodes.ranks(1) if what == "node" else [])]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    store_log, _ = nodes.end(nodes.procs[:1])
    assert nodes.procs[0].returncode == 0, store_log[-4000:]
    restart = _trained_like_one_process(nodes.out)
    assert restart["layout"]["dp"] == 1
    assert "frame #" not in store_log


@pytest.mark.slow  # an elastic fault named in the default set: the stuck rank under the launcher
@pytest.mark.timeout(300)  # 15-30 s: one rendezvous round, two rank start-ups
def test_losing_the_store_host_says_so_in_one_line_with_the_command_that_resumes(tmp_path):
    nodes = Nodes(tmp_path)
    nodes.saved(4)
    for pid in [nodes.procs[0].pid, *nodes.ranks(0)]:
        os.kill(pid, signal.SIGKILL)
    _, other_log = nodes.end(nodes.procs[1:])
    assert nodes.procs[1].returncode == 1
    said = [line for line in other_log.splitlines() if line.startswith("trainmesh: the rendezvous store at")]
    assert len(said) == 1, other_log[-4000:]
    assert "single point of failure" in said[0] and "trainmesh launch --nnodes 1:2" in said[0]
    assert f"latest checkpoint in {nodes.ckpt}" in said[0]
    assert "frame #" not in other_log and "are at least" not in other_log


@pytest.mark.slow  # 40-70 s: the frozen rank's agent stops it (SIGKILL after its grace) before both rejoin
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault, said", [("stop@1:5", "sent no heartbeat for"),
                                         ("hang@1:5", "is alive but has made no progress for")])
def test_a_frozen_or_stuck_rank_is_named_within_the_peer_timeout_and_the_run_restarts(tmp_path, fault, said):
    """SIGSTOP (the heartbeat stops) and a loop that calls no collective (the heartbeat goes on, its progress
    does not): the other rank names rank 1 after --peer-timeout 3 and ends, not after the 600 s collective
    timeout; both agents restart their ranks, which resume without the (one-off) fault."""
    nodes = Nodes(tmp_path, fault)
    nodes.end(nodes.procs, seconds=300)
    assert [p.returncode for p in nodes.procs] == [0, 0], [log.read_text()[-3000:] for log in nodes.logs]
    lines = [line for log in nodes.logs for line in log.read_text().splitlines() if said in line]
    assert len(lines) == 1 and lines[0].startswith("trainmesh: rank 0: rank 1 on "), lines
    assert nodes.logs and _trained_like_one_process(nodes.out)["restart"]["from_step"] >= 4


@pytest.mark.timeout(120)
def test_a_rank_stuck_outside_collectives_is_named_within_the_peer_timeout_under_the_launcher(tmp_path):
    """``train --nproc 2`` with the collective timeout at its 600 s default: rank 1 loops at step 3 calling no
    collective; rank 0 names it once it has waited --peer-timeout, and the job ends."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_FAULT": "hang@1:3"}
    done = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--nproc", "2", "--dp", "2", "--steps", "50",
                           "--peer-timeout", "2", "--no-progress", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=110)
    assert done.returncode == PEER_LOST_EXIT, done.stderr[-3000:]
    assert f"trainmesh: rank 0: rank 1 on {socket.gethostname()} is alive but has made no progress" in done.stderr


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_slowed_rank_is_named_a_straggler_with_its_host_in_the_log_metrics_and_report(tmp_path):
    """``slow@1:*`` adds half a second to rank 1's compute of every step: rank 1 is named on every step and
    rank 0 on none; its compute and the other's waiting show in the split."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_FAULT": "slow@1:*"}
    done = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--nproc", "2", "--dp", "2", "--steps", "4",
                           "--no-progress", "--out", str(out)], env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"trainmesh: straggler at step 1: rank 1 on {socket.gethostname()} computed" in done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["stragglers"] == [1] for r in records)
    assert all(r["compute_s"][1] > r["compute_s"][0] and r["wait_s"][0] > r["wait_s"][1] for r in records)
    shown = subprocess.run([sys.executable, "-m", "trainmesh", "report", str(out)], capture_output=True, text=True,
                           timeout=60)
    assert "stragglers named (computing slower than the median rank): rank 1 on 4 step(s)" in shown.stdout
