"""Replica groups through torchft (:mod:`trainmesh.replicas`): killing one group leaves the others training, and
the group, started again, heals from a live peer. What equals one process (float64, 1e-9): every committed step
is one process's step on the batches of the groups that committed it, concatenated (each group's batch is
``global_batch`` sequences of its own, so the groups' mean of means is the concatenation's mean)."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import trainmesh as tm
from trainmesh.distributed.mesh import Mesh
from trainmesh.distributed.testing import RankFailure, run_ranks
from trainmesh.training.optim import LRSchedule

from helpers import FP64_ATOL, Case, build, in_fp64
from helpers import config as run_config

torchft = pytest.importorskip("torchft")
from trainmesh.replicas import ReplicaGroup, lighthouse  # noqa: E402 - needs torchft

Record = tuple[int, int, float]  # (step, groups averaged, this group's loss) of each committed step


def _log(where: str, record: Record) -> None:
    """Append a committed step to the group's log (kept when the group is killed; exact float text)."""
    if os.environ["RANK"] == "0":
        with open(where, "a") as f:
            f.write(f"{record[0]} {record[1]} {record[2].hex()}\n")


def _records(where: Path) -> list[Record]:
    return [(int(s), int(n), float.fromhex(x)) for s, n, x in (line.split() for line in where.read_text().splitlines())]


def _batch(run, step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``replica``'s own batch at ``step``: no two groups read the same sequences."""
    return run.batch(step * replicas + replica)


def _fewest(participants: int) -> int:
    """The fewest groups any rank of this group saw in its quorum, so that all its ranks wait or train alike."""
    seen = torch.tensor([participants])
    torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MIN)
    return int(seen.item())


def _train_group(case: Case, address: str, replica: int, replicas: int, die_at: int | None,
                 wait_at: tuple[int, ...], log: str) -> dict[str, torch.Tensor]:
    """One rank of replica group ``replica``: train ``case.steps`` steps through torchft, logging each committed
    one to ``log``; every rank of the group exits at once when it reaches step ``die_at`` (inside the step's
    quorum, before its gradients); at the steps ``wait_at`` it waits until all ``replicas`` are in the quorum."""
    torch.set_num_threads(1)
    run = build(case)
    group = ReplicaGroup(run.parallel, run.opt, address, replica, timeout_s=10.0)
    schedule = LRSchedule(case.lr, case.min_lr, case.warmup_steps, case.steps)
    while (step := group.start_step()) < case.steps:
        if step == die_at:
            os._exit(3)
        if step in wait_at and _fewest(group.participants) < replicas:  # give the step up: quorum again
            group.manager.report_error(RuntimeError("waiting for every replica group"))
            group.manager.should_commit()
            continue
        run.opt.lr = schedule.at(step)
        loss = tm.train_step(run.parallel, run.opt, _batch(run, step, replica, replicas), max_norm=case.grad_clip)
        if group.committed(step):
            _log(log, (step, group.participants, loss))
    group.close()
    return run.parallel.state_dict()


def _reference(case: Case, committed: dict[int, list[int]], replicas: int) -> tuple[list[float], dict]:
    """One process trained at each step on the concatenated batches of the groups that committed it."""
    run = build(dataclasses.replace(case, dp=1, zero=0), mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    schedule = LRSchedule(case.lr, case.min_lr, case.warmup_steps, case.steps)
    losses = []
    for step in range(case.steps):
        parts = [_batch(run, step, g, replicas) for g in committed[step]]
        run.opt.lr = schedule.at(step)
        batch = tuple(torch.cat(t) for t in zip(*parts))
        losses.append(tm.train_step(run.parallel, run.opt, batch, max_norm=case.grad_clip))
    return losses, run.parallel.state_dict()


def _run_groups(case: Case, ranks: int, replicas: int, die_at: int, wait_at: int, logs: Path) -> list[dict]:
    """Every group's final parameters (group 1 killed at ``die_at`` and started again), side by side, one
    lighthouse; each group logs its committed steps to ``logs/<replica>``. All start together (they wait at
    step 0 for each other) and the survivor waits at ``wait_at`` for the restarted group, so that the steps
    each trains alone do not hang on how fast this host starts processes."""
    server = lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=0.5)

    def group(replica: int) -> dict:
        log = str(logs / str(replica))
        if replica == 1:
            with pytest.raises(RankFailure, match="exit code 3"):
                run_ranks(_train_group, ranks, case, server.address(), replica, replicas, die_at, (0,), log,
                          timeout=240)
        return run_ranks(_train_group, ranks, case, server.address(), replica, replicas, None,
                         (0, wait_at) if replica == 0 else (), log, timeout=240)[0]

    try:
        with ThreadPoolExecutor(replicas) as pool:
            return list(pool.map(group, range(replicas)))
    finally:
        server.shutdown()


def _check(case: Case, final: list[dict], logs: Path, replicas: int, die_at: int, wait_at: int) -> None:
    """The survivor trained through the loss; the restarted group healed and ended on its state; every committed
    step equals one process's on the batches of the groups that committed it."""
    records = [_records(logs / str(g)) for g in range(replicas)]
    committed = {s: [g for g in range(replicas) if any(r[0] == s for r in records[g])] for s in range(case.steps)}
    survivor = {s: n for s, n, _ in records[0]}
    assert sorted(survivor) == list(range(case.steps)), "the survivor trained every step once"
    alone = [s for s in range(case.steps) if survivor[s] == 1]
    assert alone and alone[0] == die_at and max(alone) < wait_at, f"steps the survivor trained alone: {alone}"
    assert all(survivor[s] == len(committed[s]) for s in range(case.steps)), (survivor, committed)
    after = [s for s, _, _ in records[1] if s >= die_at]
    assert after and after[0] > die_at, f"the restarted group trained {after}: it should have healed past {die_at}"
    losses, params = _reference(case, committed, replicas)
    for s in range(case.steps):
        mean = sum(loss for g in committed[s] for step, _, loss in records[g] if step == s) / len(committed[s])
        assert abs(mean - losses[s]) <= FP64_ATOL, f"step {s}: {mean!r} vs one process {losses[s]!r}"
    for g in range(replicas):
        for name, value in params.items():
            diff = (final[g][name] - value).abs().max().item()
            assert diff <= FP64_ATOL, f"group {g} {name}: max |diff| {diff} vs one process"


@pytest.mark.parametrize("zero", [2, pytest.param(0, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_killed_replica_group_leaves_the_other_training_and_heals_from_it(tmp_path, zero):
    case = in_fp64(run_config(dp=2, zero=zero, steps=8, global_batch=4, warmup_steps=1))
    final = _run_groups(case, ranks=2, replicas=2, die_at=2, wait_at=5, logs=tmp_path)
    _check(case, final, tmp_path, replicas=2, die_at=2, wait_at=5)
