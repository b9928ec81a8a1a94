"""``bench dp``'s bound on the DP/DDP ratio computes all that a training step computes, less the sync."""

import torch

from trainmesh.distributed.testing import run_ranks
from trainmesh.layout import Layout
from trainmesh_bench.common import Setup, build, fresh_model, init_mesh, trainmesh_step
from trainmesh_bench.dp import unsynchronised_step


def _two_steps_each() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """On one rank, where nothing is synchronised anyway: the start, trainmesh's DP after two steps, and the
    bound's model after the same two steps."""
    torch.set_num_threads(1)
    cfg = Setup("tiny", Layout(microbatches=2), global_batch=8)
    bench = build(cfg, init_mesh(cfg))
    start = [p.detach().clone() for p in fresh_model(bench).parameters()]
    model = fresh_model(bench)
    real, bound = trainmesh_step(bench), unsynchronised_step(bench, model)
    for i in range(2):
        real(i)
        bound(i)
    return start, [p.detach() for p in bench.model.module.parameters()], [p.detach() for p in model.parameters()]


def test_the_bound_trains_each_rank_as_its_data_parallel_step_does():
    """Same micro-batches, loss scaling, clipping and AdamW: a bound that skipped any of them would do less
    work than the step it bounds (the parameters would part by about the learning rate)."""
    ((start, real, bound),) = run_ranks(_two_steps_each, 1, timeout=120)
    assert max((r - s).abs().max().item() for r, s in zip(real, start)) > 1e-4
    for r, b in zip(real, bound):
        torch.testing.assert_close(b, r)
