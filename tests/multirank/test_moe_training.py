"""Mixture-of-experts models in training: the loss falls on one process and is the one-process loss at dp2
and cp2 (float64, aux terms and the bias update included); a router collapsed onto one expert is spread out by
the balance loss, and separately by the bias update; the per-step expert metrics and their report plot;
bad settings refused in one line before any rank starts."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import trainmesh as tm
from trainmesh import api
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import moe
from trainmesh.models.moe import MoE, MoEConfig
from trainmesh.distributed.testing import run_ranks
from trainmesh.parallel.tensor_parallel import is_tp_partial

from helpers import (EQUIVALENCE_TABLE, Built, Case, assert_same_training, build, check_equivalent, config,
                     describe_layout, in_fp64, train, train_single)


_cfg = functools.partial(config, model="moe-tiny", steps=6, warmup_steps=1)


def test_the_logged_loss_includes_the_weighted_aux_terms() -> None:
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    plain = train(_cfg(steps=1, precision="fp64", moe=dict(aux_coef=0.0, z_coef=0.0)), mesh=mesh)
    weighted = train(_cfg(steps=1, precision="fp64", moe=dict(aux_coef=0.5, z_coef=0.25)), mesh=mesh)
    layers = [layer.stats for _, layer in moe.moe_layers(weighted.model)]
    aux = sum(0.5 * s.aux_loss + 0.25 * s.z_loss for s in layers)
    assert weighted.losses[0] == pytest.approx(plain.losses[0] + aux, abs=1e-12)


def test_dp2_equals_one_process_with_aux_losses_and_bias_update() -> None:
    check_equivalent([_cfg(dp=2, microbatches=2, moe=dict(z_coef=0.01, bias_rate=0.01)),
                      _cfg(dp=2, model="llama-moe-tiny", moe=dict(aux_coef=0.1)),
                      _cfg(dp=2, zero=1, model="llama-moe-tiny", moe=dict(bias_rate=0.01))], world_size=2)


def test_tp2_and_pp2_equal_one_process() -> None:
    """The experts stay whole on each tp rank (the MoE families' plans leave the MLP alone); each pipeline
    stage back-propagates and reports its own layers' aux losses."""
    check_equivalent([_cfg(tp=2, moe=dict(z_coef=0.01)),
                      _cfg(pp=2, microbatches=2, moe=dict(z_coef=0.01, bias_rate=0.01))], world_size=2)


def _sequence_grad_bytes(cfg: Case) -> tuple[float, int]:
    """Runs on every rank: the bytes one step sums over tp as partial gradients, and the elements of the
    parameters whose gradients are partial over tp (router, experts, norms: the sequence region)."""
    torch.set_num_threads(1)
    run = build(cfg)
    run.forward_backward(0)
    run.engine.step(cfg.lr, cfg.grad_clip)
    partial = sum(p.numel() for p in run.model.parameters() if is_tp_partial(p))
    return run.comm.bytes.get(("tp", "sequence_grads"), 0.0), partial


def test_partial_gradients_are_summed_over_tp_once_a_step() -> None:
    """Under sequence parallelism the experts, the router and the norms stay whole on each tp rank, which
    routes or normalises only its slice of the tokens: the engine sums their accumulated gradients over tp
    once, at the step, in its fp32 buckets (2 ranks: a ring all-reduce sends the buffer once), instead of
    every micro-batch's gradient as each backward produces it."""
    cfgs = [_cfg(tp=2, sequence_parallel=True, microbatches=m) for m in (1, 4)]
    (one, partial), (four, _) = [run_ranks(_sequence_grad_bytes, 2, cfg, timeout=240)[0] for cfg in cfgs]
    assert partial > 0 and one == four == 4 * partial


@pytest.mark.parametrize("zeros", [(0, 1), (2, 3)])
def test_tp2_sequence_parallel_with_micro_batches_equals_one_process_at_every_zero_stage(zeros) -> None:
    """The partial gradients summed over tp at the step (above) under each engine: DataParallel's buckets,
    ZeRO-1/2's reduced gradient shards and ZeRO-3's expert units."""
    check_equivalent([_cfg(tp=2, sequence_parallel=True, microbatches=2, zero=z, moe=dict(bias_rate=0.01))
                      for z in zeros], world_size=2)


def _expert_tokens(run: Built) -> list[int]:
    """Token copies each MoE layer routed in the last step, summed over the ranks that saw other tokens
    (:func:`trainmesh.api.sum_over_data`, as the bias update sums them)."""
    return [int(api.sum_over_data(run.mesh, layer.stats.counts.double(), "expert_counts").sum())
            for _, layer in moe.moe_layers(run.model)]


def _train_and_count(cfg: Case) -> tuple[tuple[list[float], dict[str, torch.Tensor]], list[int]]:
    """Runs on every rank: the training and the last step's routed token copies per MoE layer."""
    torch.set_num_threads(1)
    result = train(cfg)
    return (result.losses, result.parallel.state_dict()), _expert_tokens(result)


def test_cp2_equals_one_process_and_counts_each_token_once() -> None:
    """Each cp rank routes two chunks of every sequence: the balance loss's per-sequence statistics and the
    z-loss are summed over cp (and their gradient scaled to the average over cp that the router's gradient
    gets), while the expert counts are left to the bias update's (and the metrics') own sum over dp x cp."""
    cfg = in_fp64(_cfg(cp=2, moe=dict(z_coef=0.01, bias_rate=0.01)))
    training, tokens = run_ranks(_train_and_count, 2, cfg, timeout=240)[0]
    EQUIVALENCE_TABLE.append((describe_layout(cfg), *assert_same_training(train_single(cfg), training)))
    assert tokens == [8 * 32 * 2] * 2


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [
    (2, [_cfg(cp=2, ep=2), _cfg(cp=2, cp_impl="a2a", model="llama-moe-tiny", moe=dict(z_coef=0.01))]),
    (4, [_cfg(cp=2, tp=2, sequence_parallel=True, model="llama-moe-tiny", moe=dict(z_coef=0.01)),
         _cfg(cp=2, tp=2, sequence_parallel=True, ep=2, microbatches=2, moe=dict(bias_rate=0.01))])])
def test_cp_composed_with_ep_and_sequence_parallel_equals_one_process(world, layouts) -> None:
    """cp2 x ep2 (the ep group is the two cp ranks: each routes its own chunks), a2a attention, and cp2 x tp2
    with SP, where a sequence's statistics are summed over the four ranks that share it."""
    check_equivalent(layouts, world_size=world, timeout=600)


def test_a_resumed_run_continues_exactly(tmp_path) -> None:
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    whole = _cfg(model="llama-moe-tiny", steps=4, precision="fp64")
    straight = train(whole, mesh=mesh).losses
    first = train(dataclasses.replace(whole, steps=2), mesh=mesh)
    tm.save(first.parallel, first.opt, tmp_path / "ckpt", 2)
    resumed = build(whole, mesh)
    resumed.train(start=tm.load(resumed.parallel, resumed.opt, tmp_path / "ckpt"))
    assert len(resumed.losses) == 2 and max(abs(a - b) for a, b in zip(straight[2:], resumed.losses)) < 1e-12


def test_full_recompute_counts_each_forward_once_and_changes_nothing() -> None:
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    runs = [train(_cfg(steps=3, precision="fp64", microbatches=2, recompute=mode, moe=dict(bias_rate=0.01)), mesh=mesh)
            for mode in ("none", "full")]
    assert max(abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses)) < 1e-12
    stats = [[layer.stats for _, layer in moe.moe_layers(r.model)] for r in runs]
    assert [s.forwards for s in stats[1]] == [2, 2]
    assert all(torch.equal(a.counts, b.counts) for a, b in zip(*stats))


# --- a collapsed router ----------------------------------------------------------------------------------

E, D = 4, 8


def _collapsed(score: str, aux_coef: float, bias_rate: float) -> tuple[MoE, torch.Tensor]:
    """A top-1 layer whose router sends (nearly) every token to expert 0: the tokens share a common
    direction that expert 0's gate row reads strongly."""
    cfg = MoEConfig(E, 1, 6, score=score, aux_coef=aux_coef, z_coef=0.0, bias_rate=bias_rate)
    layer = MoE(D, cfg, gated=False).double()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, D, dtype=torch.float64, generator=gen)
    x[..., 0] += 3.0
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.randn(E, D, generator=gen, dtype=torch.float64) * 0.5)
        layer.router.gate.weight[0, 0] = 3.0
    return layer, x


def _balance(layer: MoE) -> float:
    counts = layer.stats.counts.double()
    return (counts.max() / counts.mean()).item()


def test_balance_loss_spreads_a_collapsed_router() -> None:
    layer, x = _collapsed("softmax", aux_coef=1.0, bias_rate=0.0)
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.05)
    history = []
    for _ in range(40):
        moe.begin_step(layer, 1.0)
        (layer(x) * 0).sum().backward()  # only the injected balance loss has a gradient
        history.append(_balance(layer))
        opt.step()
        opt.zero_grad()
    assert history[0] > 3.5 and max(history[-10:]) < 1.5, history


def test_bias_update_alone_spreads_a_collapsed_router() -> None:
    """With sigmoid scores (DeepSeek-V3's pairing): softmax leaves the experts a collapsed router does not
    pick with scores so alike that a shared bias step moves all their tokens at once, and the sign rule
    then oscillates rather than settles (seen here: max/mean load cycling 3.8 -> 2.1 -> 3.5)."""
    layer, x = _collapsed("sigmoid", aux_coef=0.0, bias_rate=0.01)
    history = []
    for _ in range(40):
        moe.begin_step(layer, 1.0)
        layer(x)
        history.append(_balance(layer))
        moe.update_expert_bias(layer)
    assert history[0] > 3.5 and max(history[-10:]) < 1.3, history
    assert layer.router.gate.weight[0, 0] == 3.0  # the router's weights never moved


def test_dense_first_layers_equal_one_process() -> None:
    """One dense first layer (``n_dense_layers=1``, ``--moe-dense-layers 1``) in moe-tiny and llama-moe-tiny:
    under tp2 with sequence parallelism it is split as the dense family's MLP is, the MoE layer stays whole; at
    pp2 it is stage 0."""
    assert _cfg(moe=dict(n_dense_layers=1)).model_config.moe.n_dense_layers == 1
    check_equivalent([_cfg(tp=2, sequence_parallel=True, moe=dict(n_dense_layers=1)),
                      _cfg(tp=2, sequence_parallel=True, model="llama-moe-tiny", moe=dict(n_dense_layers=1)),
                      _cfg(pp=2, microbatches=2, model="llama-moe-tiny", moe=dict(n_dense_layers=1))], world_size=2)


def test_capacity_drops() -> None:
    cfg = _cfg(steps=1, moe=dict(capacity_factor=0.5))
    result = train(cfg, mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    dropped = [layer.stats.dropped / layer.stats.routed for _, layer in moe.moe_layers(result.model)]
    assert all(d >= 0.5 for d in dropped)  # capacity 0.5 takes at most half of the copies
