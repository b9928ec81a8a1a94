"""Expert parallelism's all-to-all dispatch alone, against a single-process gather of the same routing.

Every rank draws every rank's token copies and routing from one seed, so each can compute the reference
(all copies in one place, each through its expert) and compare its own part of it, in float64: forward
outputs, gradients of the copies and gradients of its experts.
"""

import pytest
import torch
import torch.distributed as dist

from helpers import check_equivalent
from trainmesh.config import Config
from trainmesh.expert_parallel import AllToAllDispatch
from trainmesh.mesh import init_distributed
from trainmesh.testing import run_ranks

D = 3
TOL = 1e-12


def _routing(world: int, n_experts: int, rows: list[int], empty_experts: tuple[int, ...]) -> list[torch.Tensor]:
    """Each rank's global expert id per copy, sorted (as the router leaves them), never an ``empty`` expert."""
    gen = torch.Generator().manual_seed(7)
    allowed = torch.tensor([e for e in range(n_experts) if e not in empty_experts])
    return [allowed[torch.randint(len(allowed), (n,), generator=gen)].sort().values for n in rows]


def _experts_apply(x: torch.Tensor, experts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` is ``tanh(x @ w[e])``: a non-linear map, so a copy sent to the wrong expert shows."""
    return torch.tanh(torch.bmm(x.unsqueeze(1), w[experts]).squeeze(1))


def _dispatch_rank(n_experts: int, rows: list[int], empty_experts: tuple[int, ...]) -> dict:
    init_distributed("gloo", torch.device("cpu"))
    world, rank = dist.get_world_size(), dist.get_rank()
    local = n_experts // world
    gen = torch.Generator().manual_seed(11)
    routing = _routing(world, n_experts, rows, empty_experts)
    xs = [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in rows]
    grads_out = [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in rows]
    w_full = torch.randn(n_experts, D, D, generator=gen, dtype=torch.float64)

    # the reference: every copy of every rank through its expert in one place
    x_ref = torch.cat(xs).requires_grad_()
    w_ref = w_full.clone().requires_grad_()
    y_ref = _experts_apply(x_ref, torch.cat(routing), w_ref)
    (y_ref * torch.cat(grads_out)).sum().backward()
    mine = slice(sum(rows[:rank]), sum(rows[:rank + 1]))

    # expert parallel: this rank's copies dispatched to the ranks holding their experts
    dispatcher = AllToAllDispatch(dist.group.WORLD)
    x = xs[rank].clone().requires_grad_()
    w = w_full[rank * local:(rank + 1) * local].clone().requires_grad_()
    counts = torch.bincount(routing[rank], minlength=n_experts)
    x_local, local_counts, handle = dispatcher.dispatch(x, counts)
    local_experts = torch.repeat_interleave(torch.arange(local), local_counts)
    y = dispatcher.combine(_experts_apply(x_local, local_experts, w), handle)
    (y * grads_out[rank]).sum().backward()
    expected_counts = torch.stack([torch.bincount(r, minlength=n_experts) for r in routing]).sum(0)
    return {"y": (y - y_ref[mine]).abs().max().item() if y.numel() else 0.0,
            "x_grad": (x.grad - x_ref.grad[mine]).abs().max().item() if x.numel() else 0.0,
            "w_grad": (w.grad - w_ref.grad[rank * local:(rank + 1) * local]).abs().max().item(),
            "counts_ok": torch.equal(local_counts, expected_counts[rank * local:(rank + 1) * local]),
            "sorted": bool((local_experts[1:] >= local_experts[:-1]).all()),
            "rows": (y.shape[0], x_local.shape[0])}


@pytest.mark.parametrize("world,n_experts,rows,empty", [
    (2, 4, [9, 0], (1, 2)),       # rank 1 sends nothing; experts 1 (on rank 0) and 2 (on rank 1) get nothing
    (4, 8, [5, 7, 0, 6], (0, 5, 6, 7)),  # rank 3 holds only experts that receive no token
], ids=["ep2", "ep4"])
def test_all_to_all_dispatch_equals_a_single_process_gather(world, n_experts, rows, empty):
    results = run_ranks(_dispatch_rank, world, n_experts, rows, empty, timeout=60)
    for rank, r in enumerate(results):
        assert r["counts_ok"] and r["sorted"], f"rank {rank}: {r}"
        assert r["rows"][0] == rows[rank]
        assert max(r["y"], r["x_grad"], r["w_grad"]) < TOL, f"rank {rank}: {r}"
    assert results[-1]["rows"][1] == 0 if world == 4 else True


def test_a_single_rank_dispatches_nothing():
    x, counts = torch.randn(4, D), torch.tensor([3, 0, 1])
    dispatcher = AllToAllDispatch(None)
    y, local_counts, handle = dispatcher.dispatch(x, counts)
    assert y is x and local_counts is counts and dispatcher.combine(y, handle) is y


def _moe(**kw) -> Config:
    base = {"model": "moe-tiny", "nproc": 2, "dp": 2, "ep": 2, "steps": 4, "global_batch": 8, "progress": False,
            "warmup_steps": 1}
    return Config(**{**base, **kw})


def test_ep2_and_ep2_with_zero3_equal_one_process():
    """Dropless MoE at ep2 (every rank half the experts, tokens by all-to-all) and under ZeRO-3 (expert
    state sharded over the expert-data-parallel group, here of one rank) train as one process does."""
    for loss_diff, param_diff in check_equivalent([_moe(), _moe(zero=3, model="llama-moe-tiny")], world_size=2):
        assert loss_diff <= 1e-9 and param_diff <= 1e-9


@pytest.mark.slow
def test_ep_layouts_on_four_ranks_equal_one_process():
    """ep4; dp4 x ep2 (experts reduced over a 2-rank expert-data-parallel group, ZeRO-1 and -2 sharding
    over it); ep2 x tp2 with and without sequence parallelism; ep2 x pp2 (aux losses injected on both
    stages)."""
    four = {"nproc": 4, "dp": 4}
    cfgs = [_moe(**four, ep=4), _moe(**four), _moe(**four, zero=1), _moe(**four, zero=2, model="llama-moe-tiny"),
            _moe(nproc=4, tp=2), _moe(nproc=4, tp=2, sequence_parallel=True, model="llama-moe-tiny"),
            _moe(nproc=4, pp=2, microbatches=2)]
    check_equivalent(cfgs, world_size=4, timeout=600)
