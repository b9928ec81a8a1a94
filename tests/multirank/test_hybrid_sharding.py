"""Hybrid sharding (HSDP, ``--dp-replicate R``): ZeRO shards inside each of R groups of dp/R ranks and the
gradient shards are all-reduced across the groups. It trains like one process (float64), composes with tp
and pp, and its checkpoints are the same global tensors, so they reload under plain ZeRO-3 and back."""

import dataclasses
import functools

import pytest
import torch

import trainmesh as tm
from trainmesh.checkpoint import read_tensors
from trainmesh.distributed.mesh import Mesh
from trainmesh.layout import Layout, LayoutError, flag, validate
from trainmesh.distributed.testing import run_ranks

from helpers import FP64_ATOL, Case, Training, build, check_equivalent, config, in_fp64, train

_hsdp = functools.partial(config, dp_replicate=2, steps=2, microbatches=2)


def test_hsdp_2x1_matches_single_process():
    """The smallest hybrid mesh: two replicas of one shard rank each, so every step crosses the replica
    all-reduce (zero-2 reduces per micro-batch inside the group, the replicas once per step)."""
    check_equivalent([_hsdp(dp=2, zero=2), _hsdp(dp=2, zero=3)], world_size=2)


@pytest.mark.slow
def test_hsdp_2x2_every_zero_stage_matches_single_process():
    check_equivalent([_hsdp(dp=4, zero=z, steps=4, bucket_mb=0.1 if z < 3 else 25.0) for z in (1, 2, 3)],
                     world_size=4, timeout=400)


@pytest.mark.slow
def test_hsdp_2x2_composes_with_tp2_and_pp2():
    check_equivalent([_hsdp(dp=4, tp=2, zero=3, sequence_parallel=True), _hsdp(dp=4, pp=2, zero=2)],
                     world_size=8, timeout=600)


def test_hsdp_refusals_name_the_flag_and_the_fix():
    for layout, words in [(Layout(dp=4, dp_replicate=3, zero=3), "does not divide --dp 4"),
                          (Layout(dp=4, dp_replicate=2), "--zero 0 shards nothing"),
                          (Layout(dp=4, dp_replicate=2, zero=3, ep=2), "--ep 1")]:
        with pytest.raises(LayoutError, match=words):
            validate(layout, spell=flag)


def _resumed(cases: list[Case], root: str) -> list[Training]:
    """Each case resumed from the checkpoint in ``root`` (but the first), trained to its last step and saved."""
    out = []
    for k, case in enumerate(cases):
        run = build(case)
        run.train(start=tm.load(run.parallel, run.opt, root) if k else 0)
        tm.save(run.parallel, run.opt, root, case.steps)
        out.append((run.losses, run.parallel.state_dict()))
    return out


@pytest.mark.slow  # 10 s; the 2x1 equivalence and the two-node bed test keep HSDP in the default set
def test_checkpoint_round_trip_hsdp_zero3_hsdp(tmp_path):
    """HSDP 2x2 trains 2 steps and saves; plain ZeRO-3 over the same 4 ranks resumes from it, trains 2 more and
    saves; HSDP resumes from that. The three pieces together are the one-process run of 6 steps, and the last
    checkpoint (HSDP's) holds the final global parameters."""
    root = str(tmp_path / "ckpt")
    steps = {"dp_replicate": 2}, {"dp_replicate": 1}, {"dp_replicate": 2}
    constant_lr = {"warmup_steps": 0, "min_lr": 3e-3, "lr": 3e-3}  # runs of 2, 4, 6 steps share one schedule
    runs = [in_fp64(config(dp=4, zero=3, steps=2 * (k + 1), **kw, **constant_lr)) for k, kw in enumerate(steps)]
    results = run_ranks(_resumed, 4, runs, root, timeout=400)[0]
    single = train(dataclasses.replace(runs[-1], dp=1, dp_replicate=1, zero=0),
                   Mesh.build(1, 1, 1, torch.device("cpu")))
    losses = [loss for run_losses, _ in results for loss in run_losses]
    assert len(losses) == 6
    assert max(abs(a - b) for a, b in zip(losses, single.losses)) <= FP64_ATOL
    reference = single.parallel.state_dict()
    saved = read_tensors(tmp_path / "ckpt" / "step-00000006", "model/")
    for name, value in reference.items():
        assert (results[-1][1][name] - value).abs().max().item() <= FP64_ATOL, name
        assert (saved[f"model/{name}"] - value).abs().max().item() <= FP64_ATOL, name
