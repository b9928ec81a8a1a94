"""Mixture-of-experts models in training: the loss falls on one process and is the one-process loss at dp2
and cp2 (float64, aux terms and the bias update included); a router collapsed onto one expert is spread out by
the balance loss, and separately by the bias update; the per-step expert metrics and their report plot;
bad settings refused in one line before any rank starts."""

from __future__ import annotations

import functools

import json

import pytest
import torch

from trainmesh.app.config import Config, ConfigError, validate
from trainmesh.distributed.mesh import Mesh
from trainmesh.tracking.records import scalars
from trainmesh.models import moe
from trainmesh.models.moe import MoE, MoEConfig
from trainmesh.tracking.report import report
from trainmesh.distributed.testing import run_ranks
from trainmesh.app.train import build, moe_metrics, rank_batch, setup_process, train
from trainmesh import api
from trainmesh.parallel.tensor_parallel import is_tp_partial

from helpers import EQUIVALENCE_TABLE, assert_same_training, check_equivalent, config, describe_layout, in_fp64, train_single


_cfg = functools.partial(config, model="moe-tiny", steps=6, warmup_steps=1, tensorboard=False)


def test_moe_tiny_trains_on_one_process_and_logs_expert_metrics(tmp_path) -> None:
    cfg = _cfg(steps=12, out=str(tmp_path / "run"), moe_z_coef=0.01)
    result = train(cfg, mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    assert result.losses[-1] < result.losses[0] - 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    layer = records[-1]["moe"]["blocks.1.mlp"]
    assert sum(layer["expert_tokens"]) == 8 * 32 * 2 and layer["dropped_fraction"] == 0
    assert layer["balance"] == max(layer["expert_tokens"]) / (sum(layer["expert_tokens"]) / 8)
    assert layer["aux_loss"] >= 1.0 - 1e-6 and layer["z_loss"] > 0  # sum f_i P_i is 1 at best
    tags = scalars(records[-1])
    assert tags["moe/blocks.1.mlp/balance"] == layer["balance"]
    assert [tags[f"moe/blocks.1.mlp/tokens/expert{e}"] for e in range(8)] == layer["expert_tokens"]
    text = report(tmp_path / "run")
    assert "expert load" in text and (tmp_path / "run" / "report.png").exists()


def test_the_logged_loss_includes_the_weighted_aux_terms() -> None:
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    plain = train(_cfg(steps=1, moe_aux_coef=0.0, moe_z_coef=0.0, precision="fp64"), mesh=mesh)
    weighted = train(_cfg(steps=1, moe_aux_coef=0.5, moe_z_coef=0.25, precision="fp64"), mesh=mesh)
    layers = [layer.stats for _, layer in moe.moe_layers(weighted.run.model)]
    aux = sum(0.5 * s.aux_loss + 0.25 * s.z_loss for s in layers)
    assert weighted.losses[0] == pytest.approx(plain.losses[0] + aux, abs=1e-12)


def test_dp2_equals_one_process_with_aux_losses_and_bias_update() -> None:
    check_equivalent([_cfg(nproc=2, dp=2, microbatches=2, moe_z_coef=0.01, moe_bias_rate=0.01),
                      _cfg(nproc=2, dp=2, model="llama-moe-tiny", moe_aux_coef=0.1),
                      _cfg(nproc=2, dp=2, zero=1, model="llama-moe-tiny", moe_bias_rate=0.01)], world_size=2)


def test_tp2_and_pp2_equal_one_process() -> None:
    """The experts stay whole on each tp rank (the MoE families' plans leave the MLP alone); each pipeline
    stage back-propagates and reports its own layers' aux losses."""
    check_equivalent([_cfg(nproc=2, tp=2, moe_z_coef=0.01),
                      _cfg(nproc=2, pp=2, microbatches=2, moe_z_coef=0.01, moe_bias_rate=0.01)], world_size=2)


def _sequence_grad_bytes(cfg: Config) -> tuple[float, int]:
    """Runs on every rank: the bytes one step sums over tp as partial gradients, and the elements of the
    parameters whose gradients are partial over tp (router, experts, norms: the sequence region)."""
    torch.set_num_threads(1)
    run = build(cfg, setup_process(cfg))
    api.forward_backward(run.model, run.engine, run.pipeline,
                         rank_batch(run, run.data.train, 0, cfg.optim.global_batch), run.criterion)
    run.engine.step(cfg.optim.lr, cfg.optim.grad_clip)
    partial = sum(p.numel() for p in run.model.parameters() if is_tp_partial(p))
    return run.comm.bytes.get(("tp", "sequence_grads"), 0.0), partial


def test_partial_gradients_are_summed_over_tp_once_a_step() -> None:
    """Under sequence parallelism the experts, the router and the norms stay whole on each tp rank, which
    routes or normalises only its slice of the tokens: the engine sums their accumulated gradients over tp
    once, at the step, in its fp32 buckets (2 ranks: a ring all-reduce sends the buffer once), instead of
    every micro-batch's gradient as each backward produces it."""
    cfgs = [_cfg(nproc=2, tp=2, sequence_parallel=True, microbatches=m) for m in (1, 4)]
    (one, partial), (four, _) = [run_ranks(_sequence_grad_bytes, 2, cfg, timeout=240)[0] for cfg in cfgs]
    assert partial > 0 and one == four == 4 * partial


@pytest.mark.parametrize("zeros", [(0, 1), (2, 3)])
def test_tp2_sequence_parallel_with_micro_batches_equals_one_process_at_every_zero_stage(zeros) -> None:
    """The partial gradients summed over tp at the step (above) under each engine: DataParallel's buckets,
    ZeRO-1/2's reduced gradient shards and ZeRO-3's expert units."""
    check_equivalent([_cfg(nproc=2, tp=2, sequence_parallel=True, microbatches=2, zero=z, moe_bias_rate=0.01)
                      for z in zeros], world_size=2)


def _train_with_metrics(cfg: Config) -> tuple[tuple[list[float], dict[str, torch.Tensor]], dict]:
    """Runs on every rank: the training and the last step's expert metrics over the global batch."""
    torch.set_num_threads(1)
    result = train(cfg)
    return (result.losses, result.run.parallel.state_dict()), moe_metrics(result.run)


def test_cp2_equals_one_process_and_counts_each_token_once() -> None:
    """Each cp rank routes two chunks of every sequence: the balance loss's per-sequence statistics and the
    z-loss are summed over cp (and their gradient scaled to the average over cp that the router's gradient
    gets), while the expert counts are left to the metrics' and the bias update's own sum over dp x cp."""
    cfg = in_fp64(_cfg(nproc=2, cp=2, moe_z_coef=0.01, moe_bias_rate=0.01))
    training, metrics = run_ranks(_train_with_metrics, 2, cfg, timeout=240)[0]
    EQUIVALENCE_TABLE.append((describe_layout(cfg), *assert_same_training(train_single(cfg), training)))
    assert [sum(layer["expert_tokens"]) for layer in metrics.values()] == [8 * 32 * 2] * 2


@pytest.mark.parametrize("model", ["moe-tiny", "deepseek-v3-tiny"])
def test_at_pp2_the_expert_metrics_cover_every_stages_layers(model: str) -> None:
    """Rank 0 writes the record but holds only the first stage (deepseek-v3-tiny's: its dense layer alone):
    the metrics are gathered from every stage, and are the one-process run's."""
    cfg = in_fp64(_cfg(nproc=2, pp=2, microbatches=2, moe_z_coef=0.01, model=model))
    metrics = run_ranks(_train_with_metrics, 2, cfg, timeout=240)[0][1]
    single = train(cfg.replace(nproc=1, pp=1), mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    expected = moe_metrics(single.run)
    assert list(metrics) == list(expected) == [f"blocks.{i}.mlp" for i in range(model == "deepseek-v3-tiny", 2)]
    for name, layer in expected.items():
        assert metrics[name]["expert_tokens"] == layer["expert_tokens"]
        assert all(abs(metrics[name][k] - layer[k]) <= 1e-9 for k in ("dropped_fraction", "aux_loss", "z_loss",
                                                                        "balance")), (name, metrics[name], layer)


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [
    (2, [_cfg(nproc=2, cp=2, ep=2), _cfg(nproc=2, cp=2, cp_impl="a2a", model="llama-moe-tiny", moe_z_coef=0.01)]),
    (4, [_cfg(nproc=4, cp=2, tp=2, sequence_parallel=True, model="llama-moe-tiny", moe_z_coef=0.01),
         _cfg(nproc=4, cp=2, tp=2, sequence_parallel=True, ep=2, microbatches=2, moe_bias_rate=0.01)])])
def test_cp_composed_with_ep_and_sequence_parallel_equals_one_process(world, layouts) -> None:
    """cp2 x ep2 (the ep group is the two cp ranks: each routes its own chunks), a2a attention, and cp2 x tp2
    with SP, where a sequence's statistics are summed over the four ranks that share it."""
    check_equivalent(layouts, world_size=world, timeout=600)


def test_a_resumed_run_continues_exactly(tmp_path) -> None:
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    straight = train(_cfg(model="llama-moe-tiny", steps=4, precision="fp64"), mesh=mesh).losses
    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpt"), model="llama-moe-tiny", precision="fp64")
    train(_cfg(steps=2, **ckpt), mesh=mesh)
    resumed = train(_cfg(steps=4, resume=True, **ckpt), mesh=mesh).losses
    assert max(abs(a - b) for a, b in zip(straight[2:], resumed)) < 1e-12


def test_full_recompute_counts_each_forward_once_and_changes_nothing() -> None:
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    runs = [train(_cfg(steps=3, precision="fp64", microbatches=2, moe_bias_rate=0.01, recompute=mode), mesh=mesh)
            for mode in ("none", "full")]
    assert max(abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses)) < 1e-12
    stats = [[layer.stats for _, layer in moe.moe_layers(r.run.model)] for r in runs]
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


# --- refusals ---------------------------------------------------------------------------------------------

REFUSALS = {
    "top-k above experts": (dict(moe_top_k=9), "--moe-top-k 9 exceeds the 8 experts per layer of moe-tiny; "
                                               "choose --moe-top-k in 1..8"),
    "fewer experts than top-k": (dict(moe_experts=1), "--moe-top-k 2 exceeds the 1 experts"),
    "capacity below 1, dropless": (dict(moe_capacity=0.5), "--moe-capacity 0.5 limits what each expert takes (below "
                                                           "1 it drops tokens even under perfect balance), but "
                                                           "routing is dropless; pass --no-moe-dropless"),
    "top-k beyond the expert groups": (dict(model="deepseek-v3-tiny", moe_top_k=6),
                                       "--moe-top-k 6 on deepseek-v3-tiny: top_k=6 experts per token, but its "
                                       "groups_per_token=2 groups of 2 experts hold only 4; lower top_k or raise "
                                       "groups_per_token"),
    "dropping without capacity": (dict(moe_dropless=False), "give the capacity factor with --moe-capacity"),
    "moe flag on a dense model": (dict(model="tiny", moe_experts=4), "--moe-experts configures mixture-of-experts "
                                                                      "layers, which tiny does not have"),
    "no layer left for experts": (dict(moe_dense_layers=2), "--moe-dense-layers 2 leaves no mixture-of-experts layer "
                                                            "among the 2 layers of moe-tiny; choose --moe-dense-layers "
                                                            "below 2, or a dense model"),
    "dense layers of a dense model": (dict(model="llama-tiny", moe_dense_layers=1),
                                      "--moe-dense-layers configures mixture-of-experts layers, which llama-tiny does "
                                      "not have"),
}


def test_dense_first_layers_from_the_command_line_equal_one_process() -> None:
    """``--moe-dense-layers 1`` gives moe-tiny and llama-moe-tiny a dense first layer: under tp2 with sequence
    parallelism it is split as the dense family's MLP is, the MoE layer stays whole; at pp2 it is stage 0."""
    assert _cfg(moe_dense_layers=1).model_config.moe.n_dense_layers == 1
    check_equivalent([_cfg(nproc=2, tp=2, sequence_parallel=True, moe_dense_layers=1),
                      _cfg(nproc=2, tp=2, sequence_parallel=True, moe_dense_layers=1, model="llama-moe-tiny"),
                      _cfg(nproc=2, pp=2, microbatches=2, moe_dense_layers=1, model="llama-moe-tiny")], world_size=2)


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_moe_settings_are_one_line(case: str) -> None:
    settings, message = REFUSALS[case]
    with pytest.raises(ConfigError) as e:
        validate(_cfg(**settings))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_capacity_with_dropping_is_accepted_and_drops() -> None:
    cfg = _cfg(moe_dropless=False, moe_capacity=0.5, steps=1)
    validate(cfg)
    result = train(cfg, mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    dropped = [layer.stats.dropped / layer.stats.routed for _, layer in moe.moe_layers(result.run.model)]
    assert all(d >= 0.5 for d in dropped)  # capacity 0.5 takes at most half of the copies
