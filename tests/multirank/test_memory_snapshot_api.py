"""Memory snapshots through the library (:mod:`trainmesh.checkpoint.memory`): two "nodes" of two ranks each
keep their snapshots in a directory of their own; with one node's memory gone, a world of two ranks, one on
a node holding nothing, restores from the survivor's own and peer copies (sent to it over Gloo), resharding
ZeRO-2 from four ranks to two, and trains on exactly as one uninterrupted process does, in float64."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from trainmesh.checkpoint import TrainingProgress, memory
from trainmesh.distributed.mesh import world_from_env
from trainmesh.distributed.testing import run_ranks

from helpers import FP64_ATOL, build, config, in_fp64, train_single

RUN_ID = "feedfacefeedfacefeedfacefeedface"
STEPS, LOST_AFTER = 6, 4
CASE = in_fp64(config(dp=4, zero=2, steps=STEPS))


def _snapshot_every_step(root: str) -> list[float]:
    """Four ranks, two per node: train :data:`LOST_AFTER` steps, snapshotting after each."""
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    rank = world_from_env()[0]
    run = build(CASE)
    keeper = memory.MemorySnapshots(run.mesh, RUN_ID, every=1, root=Path(root) / f"node{rank // 2}")
    for step in range(LOST_AFTER):
        run.train(step, step + 1)
        keeper.take(run.model, run.engine, TrainingProgress(step + 1))
    return run.losses


def _restore_and_finish(root: str) -> tuple[int, list[float]]:
    """Two ranks, one per node: rank 0's node holds nothing, rank 1's is the survivor (node 1)."""
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    rank = world_from_env()[0]
    run = build(in_fp64(config(dp=2, zero=2, steps=STEPS)))
    progress = memory.restore(run.model, run.engine, run.mesh, RUN_ID, Path(root) / ("new" if rank == 0 else "node1"))
    run.train(progress.step)
    return progress.step, run.losses


@pytest.mark.timeout(300)
def test_a_shrunk_world_restores_from_the_surviving_nodes_memory_like_one_process(tmp_path):
    before = run_ranks(_snapshot_every_step, 4, str(tmp_path), timeout=240)[0]
    shutil.rmtree(tmp_path / "node0")  # node 0 is lost with its memory
    (tmp_path / "new").mkdir()
    (step, after), _ = run_ranks(_restore_and_finish, 2, str(tmp_path), timeout=240)
    assert step == LOST_AFTER
    reference, _ = train_single(CASE)
    assert len(before + after) == STEPS
    for k, (got, want) in enumerate(zip(before + after, reference)):
        assert abs(got - want) <= FP64_ATOL, f"step {k + 1}: {got} vs {want}"
