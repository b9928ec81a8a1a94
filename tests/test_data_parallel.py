"""Data parallel: same losses and parameters as one process; buckets overlap backward; bytes are counted."""

import pytest
import torch

from trainmesh.config import Config
from trainmesh.testing import run_ranks
from trainmesh.train import build, forward_backward, rank_batch, setup_process

from helpers import check_equivalent


def _cfg(dp: int, microbatches: int, **kw) -> Config:
    return Config(nproc=dp, dp=dp, steps=10, global_batch=8, microbatches=microbatches, progress=False,
                  warmup_steps=2, **kw)


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_single_process(dp):
    check_equivalent([_cfg(dp, 1), _cfg(dp, 2, bucket_mb=0.1)], world_size=dp)


def _one_step_events(cfg: Config):
    torch.set_num_threads(1)
    run = build(cfg, setup_process(cfg))
    grad_bytes = sum(p.numel() * p.element_size() for p in run.model.parameters())
    forward_backward(run, rank_batch(run, run.data.train, 0, cfg.global_batch))
    events = list(run.engine.events)
    run.engine.step(cfg.lr, cfg.grad_clip)
    return events, len(run.engine.buckets), grad_bytes, dict(run.comm.bytes)


def test_bucket_allreduce_overlaps_backward_and_bytes_are_counted():
    cfg = _cfg(2, 1, bucket_mb=0.05)
    events, n_buckets, grad_bytes, counted = run_ranks(_one_step_events, 2, cfg)[0]
    assert n_buckets > 2
    kinds = [kind for kind, _ in events]
    first_launch, last_ready = kinds.index("launch"), len(kinds) - 1 - kinds[::-1].index("ready")
    assert first_launch < last_ready, "no bucket AllReduce was launched before backward finished"
    launched = [i for kind, i in events if kind == "launch"]
    assert launched == list(range(n_buckets)), "buckets must launch in index order on every rank"
    n = 2
    assert counted[("dp", "all_reduce")] == pytest.approx(grad_bytes * 2 * (n - 1) / n, rel=1e-12)
