"""Multi-node runs over a real link: two "nodes" are two network namespaces joined by rate-limited veths
(:mod:`trainmesh.distributed.testbed`), each running ``trainmesh launch --nnodes 2 --node-rank K`` or torchrun; Gloo and
the rendezvous bind to the namespaces' private addresses only. Runs match one process in float64, a rank
killed on one node is named by node and rank on both, and nothing is left behind (processes, namespaces,
shared-memory segments: the ``bed`` fixture checks after every test)."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainmesh.app.config import Config
from trainmesh.distributed.testbed import TestBed, missing_capability

from helpers import FP64_ATOL, assert_same_training
from runs import config, in_fp64, train_single

RANK_SCRIPT = Path(__file__).with_name("netbed_rank.py")
PORT = 29641
RATE_MBIT = 200


@pytest.fixture
def bed():
    """Two nodes, 200 Mbit/s each way between them; removed whatever the test did."""
    reason = missing_capability()
    if reason:
        pytest.skip(reason)
    shm_before = set(os.listdir("/dev/shm"))
    with TestBed(2, rate_mbit=RATE_MBIT) as made:
        yield made
        left = made.pids()
    assert not left, f"processes left in the bed: {left}"
    assert made.tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert set(os.listdir("/dev/shm")) <= shm_before


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRAINMESH_STORE_CLIENT")}
    return {**env, "OMP_NUM_THREADS": "1", "TRAINMESH_HOST_TRANSPORT": "auto"}


def _launch_nodes(bed: TestBed, cfg: Config, out: Path, extra_env: dict[str, str] | None = None,
                  timeout: float = 200.0) -> list[tuple[int, str]]:
    """``trainmesh launch`` on each node, half the ranks each; returns each node's exit code and stderr."""
    argv = lambda k: [sys.executable, "-m", "trainmesh", "launch", "--nnodes", "2", "--node-rank", str(k),
                      "--master-addr", bed.members[0].addr, "--master-port", str(PORT), "--nproc", str(cfg.launch.nproc // 2),
                      str(RANK_SCRIPT), json.dumps(cfg.settings()), str(out)]
    procs = [bed.start(k, argv(k), env={**_env(), **(extra_env or {})}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True) for k in range(2)]
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def _equivalent(cfg: Config, out: Path) -> None:
    assert_same_training(train_single(cfg), torch.load(out, weights_only=False))


def _matches_one_process(bed: TestBed, cfg: Config, out: Path) -> None:
    results = _launch_nodes(bed, cfg, out)
    assert [rc for rc, _ in results] == [0, 0], results
    _equivalent(cfg, out)
    assert bed.link_bytes() > 0


@pytest.mark.timeout(300)
def test_two_nodes_of_one_rank_match_one_process(bed, tmp_path):
    """The smallest: dp 2, one rank per node, HSDP replicas across the link."""
    _matches_one_process(bed, in_fp64(config(dp=2, zero=3, dp_replicate=2, steps=2, nproc=2)), tmp_path / "out.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_of_two_ranks_match_one_process(bed, tmp_path):
    """dp 4 over 2 nodes: plain dp, and ZeRO-3 sharded inside each node and replicated across (HSDP 2x2)."""
    for k, cfg in enumerate([config(dp=4, steps=2, nproc=4), config(dp=4, zero=3, dp_replicate=2, steps=2, nproc=4)]):
        _matches_one_process(bed, in_fp64(cfg), tmp_path / f"out{k}.pt")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dp_and_tp_inside_a_node_match_one_process_under_torchrun(bed, tmp_path):
    cfg = in_fp64(config(dp=2, tp=2, steps=2, nproc=4))
    out = tmp_path / "out.pt"
    argv = lambda k: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                      "--node-rank", str(k), "--master-addr", bed.members[0].addr, "--master-port", str(PORT),
                      str(RANK_SCRIPT), json.dumps(cfg.settings()), str(out)]
    procs = [bed.start(k, argv(k), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    _equivalent(cfg, out)


@pytest.mark.slow  # 20-30 s; the launchers' report itself is checked in the default set (test_elastic_layout.py)
@pytest.mark.timeout(300)
def test_a_rank_killed_on_one_node_is_named_by_node_and_rank_and_nothing_is_left(bed, tmp_path):
    cfg = config(dp=2, steps=20, nproc=2)
    results = _launch_nodes(bed, cfg, tmp_path / "out.pt", {"TRAINMESH_FAULT": "kill@1:1"})
    assert all(rc != 0 for rc, _ in results), results
    for rc, err in results:
        assert "rank 1 on node 1 failed (killed by signal SIGKILL)" in err, err[-3000:]


ELASTIC_TRAIN = ["--dp", "3", "--steps", "8", "--global-batch", "12", "--warmup-steps", "2", "--precision", "fp64",
                 "--checkpoint-every", "2", "--resume", "--no-progress"]
RDZV_CONF = "join_timeout=120,last_call_timeout=10"


def _ended_within(bed: TestBed, procs: list[subprocess.Popen], seconds: float) -> bool:
    """Whether ``procs`` all ended within ``seconds``; if not, every rank still running prints each thread's
    Python stack into its node's log (SIGUSR1, :func:`trainmesh.app.train.setup_process`), for the failure
    to show where it waited."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    if all(p.poll() is not None for p in procs):
        return True
    for pid in bed.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"torch.distributed.run" not in argv and b"trainmesh\0train" in b"\0".join(argv):
                os.kill(pid, signal.SIGUSR1)
        except (FileNotFoundError, ProcessLookupError):
            pass
    time.sleep(2)
    return False


def _a_lost_node_trains_on_like_one_process(tmp_path: Path, launcher: Callable[[TestBed, list[str]], list[str]],
                                            env: dict[str, str]) -> None:
    """3 nodes of one rank each under ``launcher(bed, train flags)``: node 2 is killed once step 4 is saved; the
    agents of nodes 0 and 1 restart their ranks as a world of 2, which resumes from step 4 at dp 2 and
    finishes. Every step's loss, before and after, is one process's."""
    reason = missing_capability()
    if reason:
        pytest.skip(reason)
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    cfg = in_fp64(config(dp=3, steps=8, global_batch=12, nproc=3))
    train = [*ELASTIC_TRAIN, "--checkpoint-dir", str(ckpt), "--out", str(out)]
    with TestBed(3, rate_mbit=RATE_MBIT) as bed:
        logs = [open(tmp_path / f"node{k}.log", "w") for k in range(3)]
        procs = [bed.start(k, launcher(bed, train), env={**_env(), **env}, stdout=subprocess.DEVNULL,
                           stderr=logs[k]) for k in range(3)]
        deadline = time.monotonic() + 300
        while not (ckpt / "step-00000004").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "step 4 was never saved"
            time.sleep(0.2)
        bed.kill_node(2)
        ended = _ended_within(bed, procs[:2], 300)
        tails = [(tmp_path / f"node{k}.log").read_text()[-6000:] for k in range(3)]
        assert ended and [p.returncode for p in procs[:2]] == [0, 0], tails
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    restart = next(r for r in records if r.get("restart", {}).get("from_step", 0) > 0)
    assert restart["step"] == 5 and restart["layout"]["dp"] == 2 and records[0]["layout"]["dp"] == 3
    reference, _ = train_single(cfg)
    for r in records:
        assert abs(r["loss"] - reference[r["step"] - 1]) <= FP64_ATOL, f"step {r['step']}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_node_restarts_on_the_two_that_remain_and_trains_on_like_one_process(tmp_path):
    """torchrun's elastic agent (``--nnodes 2:3``, c10d rendezvous) and ``train --elastic``."""
    def torchrun(bed: TestBed, train: list[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{bed.members[0].addr}:{PORT}", "--rdzv-id", "elastic",
                "--rdzv-conf", RDZV_CONF, "--max-restarts", "3", "--monitor-interval", "0.5",
                "-m", "trainmesh", "train", "--elastic", *train]

    # a fresh store per rendezvous round (docs/multinode.md)
    _a_lost_node_trains_on_like_one_process(tmp_path, torchrun, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_node_restarts_under_trainmesh_launch_with_a_minimum_node_count(tmp_path):
    """``trainmesh launch --nnodes 2:3``: the same, with torch's elastic agent started by trainmesh, which adds
    ``--elastic`` and sets the store variable itself."""
    def launch(bed: TestBed, train: list[str]) -> list[str]:
        return [sys.executable, "-m", "trainmesh", "launch", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-endpoint", f"{bed.members[0].addr}:{PORT}", "--rdzv-id", "elastic", "--rdzv-conf", RDZV_CONF,
                "train", *train]

    _a_lost_node_trains_on_like_one_process(tmp_path, launch, {})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_losing_the_node_that_hosts_the_rendezvous_store_ends_the_others_in_one_line_naming_the_command(tmp_path):
    """``trainmesh launch --nnodes 2:3``, node 0 (the ``--rdzv-endpoint`` address, whose agent hosts the c10d
    store) killed once step 4 is saved: nodes 1 and 2 cannot meet again, and each ends in one line saying
    the store's host is lost, a single point of failure, and the command that resumes; no C++ frames."""
    reason = missing_capability()
    if reason:
        pytest.skip(reason)
    ckpt = tmp_path / "ckpt"
    train = [*ELASTIC_TRAIN, "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "run")]
    with TestBed(3, rate_mbit=RATE_MBIT) as bed:
        argv = [sys.executable, "-m", "trainmesh", "launch", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-endpoint", f"{bed.members[0].addr}:{PORT}", "--rdzv-id", "elastic", "--rdzv-conf", RDZV_CONF,
                "train", *train]
        logs = [tmp_path / f"node{k}.log" for k in range(3)]
        procs = [bed.start(k, argv, env=_env(), stdout=subprocess.DEVNULL, stderr=logs[k].open("w")) for k in range(3)]
        deadline = time.monotonic() + 300
        while not (ckpt / "step-00000004").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "step 4 was never saved"
            time.sleep(0.2)
        bed.kill_node(0)
        ended = _ended_within(bed, procs[1:], 200)
        tails = [log.read_text() for log in logs[1:]]
        assert ended and [p.returncode for p in procs[1:]] == [1, 1], [t[-4000:] for t in tails]
    for tail in tails:
        said = [line for line in tail.splitlines() if line.startswith("trainmesh: the rendezvous store at")]
        assert len(said) == 1 and "single point of failure" in said[0] and str(ckpt) in said[0], tail[-4000:]
        assert "frame #" not in tail


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_frozen_rank_on_the_bed_is_named_within_the_peer_timeout_and_all_nodes_go_on_like_one_process(tmp_path):
    """``trainmesh launch --nnodes 2:3``, rank 2 SIGSTOPped at step 5 (``stop@2:5``): a peer names it by its
    heartbeat after ``--peer-timeout 3`` (not the 600 s collective timeout), the agents restart every node's
    ranks (the frozen one SIGKILLed by its agent), and all three resume at dp 3; every loss is one process's."""
    reason = missing_capability()
    if reason:
        pytest.skip(reason)
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    train = [*ELASTIC_TRAIN, "--peer-timeout", "3", "--checkpoint-dir", str(ckpt), "--out", str(out)]
    with TestBed(3, rate_mbit=RATE_MBIT) as bed:
        argv = [sys.executable, "-m", "trainmesh", "launch", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-endpoint", f"{bed.members[0].addr}:{PORT}", "--rdzv-id", "elastic", "--rdzv-conf", RDZV_CONF,
                "train", *train]
        logs = [tmp_path / f"node{k}.log" for k in range(3)]
        procs = [bed.start(k, argv, env={**_env(), "TRAINMESH_FAULT": "stop@2:5"}, stdout=subprocess.DEVNULL,
                           stderr=logs[k].open("w")) for k in range(3)]
        ended = _ended_within(bed, procs, 400)
        tails = [log.read_text() for log in logs]
        assert ended and [p.returncode for p in procs] == [0, 0, 0], [t[-4000:] for t in tails]
    named = [line for t in tails for line in t.splitlines() if "rank 2 on " in line and "sent no heartbeat" in line]
    assert named, [t[-4000:] for t in tails]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    restart = next(r for r in records if r.get("restart", {}).get("from_step", 0) > 0)
    assert restart["layout"]["dp"] == 3
    reference, _ = train_single(in_fp64(config(dp=3, steps=8, global_batch=12, nproc=3)))
    for r in records:
        assert abs(r["loss"] - reference[r["step"] - 1]) <= FP64_ATOL, f"step {r['step']}"
