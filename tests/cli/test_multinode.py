"""Multi-node runs as users start them: ``torchrun`` on every node, or one ``srun`` task per rank.

Two "nodes" are two launcher processes on 127.0.0.1; each run's per-step losses (rank 0's metrics.jsonl)
must equal a single process's on the same global batch.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainmesh.app.config import Config
from trainmesh.distributed.mesh import first_host, world_env

from helpers import FP64_ATOL
from runs import train_single

STEPS, GLOBAL_BATCH = 3, 8
TRAIN = ["-m", "trainmesh", "train", "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH), "--no-progress",
         "--precision", "fp64"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TRAINMESH_STORE_CLIENT", "TRAINMESH_FAULT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    """This test's environment without any launcher's variables (pytest may itself run under one)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith("SLURM_")}
    return {**env, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra}


def _run_nodes(commands: list[list[str]], envs: list[dict[str, str]], timeout: float) -> None:
    """Start every "node" at once (they rendezvous with each other) and wait for all; kill all on timeout."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(commands, envs)]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{err[-4000:]}"


def _losses(out: Path, world_size: int) -> list[float]:
    """Rank 0's per-step losses, after checking the run really had ``world_size`` ranks."""
    assert json.loads((out / "summary.json").read_text())["world_size"] == world_size
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_single_process_losses(losses: list[float]) -> None:
    reference, _ = train_single(Config.from_settings(steps=STEPS, global_batch=GLOBAL_BATCH, progress=False, precision="fp64"))
    assert len(losses) == len(reference)
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= FP64_ATOL, f"step {step}: loss {a} vs single-process {b}"


@pytest.mark.slow  # the multi-node launch stays in the default set under srun (the next test)
@pytest.mark.timeout(300)
def test_torchrun_two_nodes_of_two_ranks_match_one_process(tmp_path):
    out, endpoint = tmp_path / "run", f"127.0.0.1:{_free_port()}"
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, *TRAIN, "--dp", "4", "--out", str(out)]
    _run_nodes([node, node], [_clean_env(), _clean_env()], timeout=240)
    _assert_single_process_losses(_losses(out, world_size=4))


@pytest.mark.timeout(300)
def test_srun_tasks_as_ranks_match_one_process(tmp_path):
    """What ``srun --ntasks-per-node=2 trainmesh train --dp 2`` gives each task: no torchrun variables."""
    out, port = tmp_path / "run", str(_free_port())
    task = [sys.executable, *TRAIN, "--dp", "2", "--out", str(out)]
    envs = [_clean_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2", SLURM_NODEID="0",
                       SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="127.0.0.1", MASTER_PORT=port)
            for r in range(2)]
    _run_nodes([task, task], envs, timeout=240)
    _assert_single_process_losses(_losses(out, world_size=2))


SLURM_TASK_3_OF_4 = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                     "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[007-008]",
                     "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9", "SLURM_JOB_ID": "4242"}


def test_world_from_slurm_variables():
    world = world_env(SLURM_TASK_3_OF_4)
    assert (world.source, world.rank, world.world_size, world.local_rank, world.local_world_size) == \
        ("slurm", 3, 4, 1, 2)
    assert (world.master_addr, world.master_port) == ("gpu007", 15000 + 4242)
    assert world.is_rank


@pytest.mark.parametrize("env, expect", [
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}, 3),
    ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None, "SLURM_NTASKS_PER_NODE": "2"}, 2),
    ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_NODEID": None, "SLURM_JOB_NUM_NODES": "4"}, 1),
])
def test_tasks_on_this_node(env, expect):
    merged = {k: v for k, v in {**SLURM_TASK_3_OF_4, **env}.items() if v is not None}
    assert world_env(merged).local_world_size == expect


def test_torchrun_variables_win_and_slurm_alone_needs_several_tasks():
    torchrun = {**SLURM_TASK_3_OF_4, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert (world_env(torchrun).source, world_env(torchrun).rank, world_env(torchrun).world_size) == ("env", 5, 8)
    one_task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "1"}
    assert world_env(one_task).source == "single" and not world_env(one_task).is_rank


def test_master_address_falls_back_to_the_launch_node_and_can_be_overridden():
    no_list = {k: v for k, v in SLURM_TASK_3_OF_4.items() if k != "SLURM_STEP_NODELIST"}
    assert world_env(no_list).master_addr == "10.0.0.9"
    override = {**SLURM_TASK_3_OF_4, "MASTER_ADDR": "head", "MASTER_PORT": "29500"}
    assert (world_env(override).master_addr, world_env(override).master_port) == ("head", 29500)


@pytest.mark.parametrize("nodelist, first", [("gpu[007-009,12],cpu1", "gpu007"), ("r[1-2]n[3-4]", "r1n3"),
                                             ("node5", "node5"), ("a-b[3],c", "a-b3")])
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first
