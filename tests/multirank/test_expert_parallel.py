"""Expert parallelism's all-to-all dispatch alone, against a single-process gather of the same routing.

Every rank draws every rank's token copies and routing from one seed, so each can compute the reference
(all copies in one place, each through its expert) and compare its own part of it, in float64: forward
outputs, gradients of the copies and gradients of its experts.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainmesh as tm

from helpers import Case, Training, assert_same_training, build, check_equivalent, config, in_fp64, train_single
from trainmesh.parallel.expert_parallel import AllToAllDispatch
from trainmesh.distributed.comm import Comm
from trainmesh.distributed.mesh import Mesh, init_distributed
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import spec_of

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
    comm = Comm(Mesh.build(1, world, 1, torch.device("cpu"), ep=world))
    dispatcher = AllToAllDispatch(comm)
    x = xs[rank].clone().requires_grad_()
    w = w_full[rank * local:(rank + 1) * local].clone().requires_grad_()
    counts = torch.bincount(routing[rank], minlength=n_experts)
    x_local, local_counts, handle = dispatcher.dispatch(x, counts)
    local_experts = torch.repeat_interleave(torch.arange(local), local_counts)
    y = dispatcher.combine(_experts_apply(x_local, local_experts, w), handle)
    (y * grads_out[rank]).sum().backward()
    expected_counts = torch.stack([torch.bincount(r, minlength=n_experts) for r in routing]).sum(0)
    mine_experts = [((r >= rank * local) & (r < (rank + 1) * local)).sum().item() for r in routing]
    sent, returned = rows[rank] - mine_experts[rank], sum(mine_experts) - mine_experts[rank]  # copies leaving
    row = D * 8
    expected_bytes = {"ep/moe_counts": (world - 1) * local * 8, "ep/moe_dispatch": sent * row,
                      "ep/moe_combine": returned * row, "ep/moe_dispatch_backward": returned * row,
                      "ep/moe_combine_backward": sent * row}
    return {"bytes": comm.snapshot(), "expected_bytes": expected_bytes,
            "y": (y - y_ref[mine]).abs().max().item() if y.numel() else 0.0,
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
    """And each rank's comm counts, per op on the ep axis, the bytes of the copies that leave it (a routing
    known in advance, copies to its own experts staying) and (ep-1)/ep of the expert counts."""
    results = run_ranks(_dispatch_rank, world, n_experts, rows, empty, timeout=60)
    for rank, r in enumerate(results):
        assert r["counts_ok"] and r["sorted"], f"rank {rank}: {r}"
        assert r["rows"][0] == rows[rank]
        assert max(r["y"], r["x_grad"], r["w_grad"]) < TOL, f"rank {rank}: {r}"
        assert r["bytes"] == r["expected_bytes"], f"rank {rank}: counted {r['bytes']}, sent {r['expected_bytes']}"
    assert results[-1]["rows"][1] == 0 if world == 4 else True


def test_a_single_rank_dispatches_nothing():
    x, counts = torch.randn(4, D), torch.tensor([3, 0, 1])
    dispatcher = AllToAllDispatch(None)
    y, local_counts, handle = dispatcher.dispatch(x, counts)
    assert y is x and local_counts is counts and dispatcher.combine(y, handle) is y


def _moe(**kw) -> Case:
    return config(**{"model": "moe-tiny", "dp": 2, "ep": 2, "steps": 4, "warmup_steps": 1, **kw})


def test_ep2_and_ep2_with_zero3_equal_one_process():
    """Dropless MoE at ep2 (every rank half the experts, tokens by all-to-all) and under ZeRO-3 (expert
    state sharded over the expert-data-parallel group, here of one rank) train as one process does."""
    for loss_diff, param_diff in check_equivalent([_moe(), _moe(zero=3, model="llama-moe-tiny")], world_size=2):
        assert loss_diff <= 1e-9 and param_diff <= 1e-9


def test_ep_folds_over_tp_under_sequence_parallel():
    """Under sequence parallelism each tp rank routes its own slice of the sequence, so an ep group may take
    the tp ranks (here ep2 = the two tp ranks of dp1): each holds half the experts, which receive both
    slices' tokens by all-to-all, and no expert gradient is summed over tp; under ZeRO 1 and 3 too."""
    check_equivalent([_moe(dp=1, tp=2, sequence_parallel=True, microbatches=2),
                      _moe(dp=1, tp=2, sequence_parallel=True, zero=1, moe=dict(bias_rate=0.01)),
                      _moe(dp=1, tp=2, sequence_parallel=True, zero=3, model="llama-moe-tiny")], world_size=2)


def _expert_group_ranks(sequence_parallel: bool, ep: int) -> tuple[list[int], list[int]]:
    mesh = tm.init_mesh(dp=2, tp=2, ep=ep, sequence_parallel=sequence_parallel)
    return tuple(dist.get_process_group_ranks(g) if g is not None else [dist.get_rank()]
                 for g in (mesh.group("ep"), mesh.group("edp")))


@pytest.mark.parametrize("sequence_parallel,ep,groups", [
    (True, 2, [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]),
    (True, 4, [([0, 1, 2, 3], [r]) for r in range(4)]),
    (False, 2, [([0, 2], [0]), ([1, 3], [1]), ([0, 2], [2]), ([1, 3], [3])])])
def test_ep_groups_are_whole_tp_groups_under_sequence_parallel(sequence_parallel, ep, groups):
    """dp2 x tp2 (ranks tp-innermost): under SP, ep2 is each tp pair (one node on a GPU cluster) and its
    expert-data-parallel group the same tp rank of each pair, ep4 all four; without SP the tp ranks hold the
    same tokens, so ep2 is the dp pair at each tp rank, as before."""
    assert [tuple(g) for g in run_ranks(_expert_group_ranks, 4, sequence_parallel, ep, timeout=120)] == groups


def _parallelize_error(sequence_parallel: bool) -> str:
    cfg = _moe(dp=1, tp=2, sequence_parallel=sequence_parallel)
    mesh = tm.init_mesh(tp=2, ep=2, sequence_parallel=True)
    try:
        tm.parallelize(spec_of(cfg.model).builder(cfg.model_config, cfg.seed), mesh, sequence_parallel=sequence_parallel)
    except ValueError as e:
        return str(e)
    return ""


def test_a_mesh_folded_over_tp_is_refused_without_sequence_parallelism():
    """Without SP both tp ranks would route the same tokens into one ep group and train on them twice."""
    refused, accepted = (run_ranks(_parallelize_error, 2, sp, timeout=120)[0] for sp in (False, True))
    assert "pass sequence_parallel=True to parallelize" in refused and "\n" not in refused and accepted == ""


def test_a_checkpoint_saved_with_ep_folded_over_tp_resumes_on_one_process(tmp_path):
    """The experts of the two tp ranks are different pieces of the full tensors, so both are saved."""
    saved = in_fp64(_moe(dp=1, ep=2, tp=2, sequence_parallel=True, moe=dict(bias_rate=0.05)))
    run_ranks(_saved_at_step_2, 2, saved, str(tmp_path), timeout=300)
    reference = train_single(in_fp64(_moe(moe=dict(bias_rate=0.05))))
    single = _resumed(_on_one_process(saved), str(tmp_path), Mesh.build(1, 1, 1, torch.device("cpu")))
    assert_same_training((reference[0][2:], reference[1]), single)


FOUR = {"dp": 4}
COMPOSED = {
    "ep4 and dp4 x ep2 with ZeRO 0-2": [_moe(**FOUR, ep=4), _moe(**FOUR), _moe(**FOUR, zero=1),
                                         _moe(**FOUR, zero=2, model="llama-moe-tiny")],
    "ep2 x tp2": [_moe(tp=2), _moe(tp=2, model="llama-moe-tiny", recompute="full")],
    "ep2 x tp2 sp": [_moe(tp=2, sequence_parallel=True, model="llama-moe-tiny"),
                     _moe(tp=2, sequence_parallel=True, ep=4, zero=2, microbatches=2)],
    "ep2 x pp2": [_moe(pp=2, microbatches=2), _moe(pp=2, microbatches=2, zero=1,
                                                            model="llama-moe-tiny")],
}


@pytest.mark.slow
@pytest.mark.parametrize("layouts", COMPOSED)
def test_ep_layouts_on_four_ranks_equal_one_process(layouts):
    """ep4; dp4 x ep2 (experts reduced over a 2-rank expert-data-parallel group, ZeRO-1 and -2 sharding
    over it); ep2 x tp2 with and without sequence parallelism (and recompute); ep2 x pp2 (aux losses
    injected on both stages, the logged loss summed over them)."""
    check_equivalent(COMPOSED[layouts], world_size=4, timeout=600)


def _saved_at_step_2(case: Case, directory: str) -> None:
    """Runs on every rank: the first two of ``case``'s steps, saved to ``directory`` (tm.save)."""
    torch.set_num_threads(1)
    run = build(case)
    run.train(stop=2)
    tm.save(run.parallel, run.opt, directory, 2)


def _resumed(case: Case, directory: str, mesh: Mesh | None = None) -> Training:
    """Runs on every rank: ``case`` resumed from the checkpoint in ``directory`` (tm.load) to its last step."""
    torch.set_num_threads(1)
    run = build(case, mesh)
    run.train(start=tm.load(run.parallel, run.opt, directory))
    return run.losses, run.parallel.state_dict()


def _on_one_process(case: Case) -> Case:
    return dataclasses.replace(case, dp=1, ep=1, tp=1, sequence_parallel=False)


def _resumes_everywhere(root: Path, saved_ep: int, resumed_eps: tuple[int, ...], **kw) -> None:
    """Train at dp=ep=``saved_ep``, then resume its step-2 checkpoint at each of ``resumed_eps``
    (dp=ep) and on one process: the experts' pieces are placed in the full tensors, so every layout reads
    its own slices, and finishes as a single process trained straight through does (the routing biases,
    with ``moe_bias_rate``, among the final state compared)."""
    saved = in_fp64(_moe(dp=saved_ep, ep=saved_ep, **kw))
    run_ranks(_saved_at_step_2, saved_ep, saved, str(root), timeout=300)
    reference = train_single(saved)
    for ep in resumed_eps:
        resumed = run_ranks(_resumed, ep, dataclasses.replace(saved, dp=ep, ep=ep), str(root), timeout=300)
        assert_same_training((reference[0][2:], reference[1]), resumed[0])
    single = _resumed(_on_one_process(saved), str(root), Mesh.build(1, 1, 1, torch.device("cpu")))
    assert_same_training((reference[0][2:], reference[1]), single)


def test_a_checkpoint_saved_at_ep2_resumes_on_one_process_with_its_routing_bias(tmp_path):
    _resumes_everywhere(tmp_path, 2, (), moe=dict(bias_rate=0.05))


@pytest.mark.slow
def test_a_checkpoint_saved_at_ep4_resumes_at_ep2_and_on_one_process(tmp_path):
    _resumes_everywhere(tmp_path, 4, (2,), moe=dict(bias_rate=0.05))
