"""Expert tensor parallelism: each routed expert's FFN split over etp ranks (w1/w3 and their biases by column, w2 by
row, the down projection's bias added once to the summed partial outputs), tokens gathered over them and the partial
outputs summed back, trains ``moe-tiny`` in float64 exactly as one process does, alone, with ZeRO-3, under tp with
sequence parallelism, and composed with ep; so does GPT-OSS (biased, clamped experts) at etp2 and, slow, at ep2 x
etp2 (also folded over tp2 with SP) and etp2 ZeRO-3, and so do Qwen3-MoE and DeepSeek-V3 (shared experts, a dense
first layer) at etp2, with a gradient-norm bound small enough to clip; a checkpoint of ``gpt-oss-tiny``'s
etp-sharded experts and biases comes back whole and at another layout."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import trainmesh as tm
from helpers import assert_same_training, check_equivalent
from helpers import config as run_config
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import preset, spec_of

STEPS, BATCH, SEQ, MICRO, LR, MAX_NORM = 3, 8, 16, 2, 3e-3, 0.05


def batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, preset(name).vocab_size, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def build(layout: dict, name: str) -> tuple[tm.ParallelModel, tm.Optimizer]:
    """Preset ``name`` at ``layout`` (``init_mesh`` sizes under ``mesh``, the rest ``parallelize``'s) and its
    optimizer."""
    layout = dict(layout)
    mesh = tm.init_mesh(**layout.pop("mesh"))
    model = tm.parallelize(spec_of(name).builder(preset(name), 0), mesh, precision="fp64", microbatches=MICRO,
                           **layout)
    return model, tm.optimizer(model, lr=LR)


def train(layout: dict, save_to: Path | None = None, name: str = "moe-tiny"
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and full weights of preset ``name`` trained at ``layout``; saved to ``save_to`` if given."""
    model, opt = build(layout, name)
    losses = [tm.train_step(model, opt, batch, max_norm=MAX_NORM) for batch in batches(name)]
    if save_to is not None:
        tm.save(model, opt, save_to, STEPS)
    return losses, model.state_dict()


def restored(layout: dict, directory: Path, name: str) -> dict[str, torch.Tensor]:
    """The full weights preset ``name`` at ``layout`` holds after loading the checkpoint in ``directory``."""
    model, opt = build(layout, name)
    tm.load(model, opt, directory)
    return model.state_dict()


def train_layouts(layouts: list[dict]) -> list:
    torch.set_num_threads(1)
    return [train(layout) for layout in layouts]


def assert_layouts_match_one_process(layouts: list[dict], world: int) -> None:
    reference = train(dict(mesh={}))
    per_rank = run_ranks(train_layouts, world, layouts, timeout=300)
    for i, layout in enumerate(layouts):
        loss, param = assert_same_training(reference, per_rank[0][i])
        print(f"moe-tiny {layout}: |dloss| {loss:.1e} |dparam| {param:.1e}")


def test_etp2_alone_with_zero3_and_under_tp2_with_sequence_parallel_trains_as_one_process():
    assert_layouts_match_one_process([dict(mesh=dict(etp=2)), dict(mesh=dict(etp=2), zero=3),
                                      dict(mesh=dict(tp=2, etp=2, sequence_parallel=True), sequence_parallel=True)],
                                     world=2)


@pytest.mark.slow
def test_etp2_by_ep2_trains_as_one_process():
    assert_layouts_match_one_process([dict(mesh=dict(ep=2, etp=2))], world=4)


_family = functools.partial(run_config, steps=3, global_batch=4, warmup_steps=1, grad_clip=MAX_NORM)


def test_gpt_oss_at_etp2_trains_as_one_process():
    """Each etp rank adds its columns of the gate and up biases; only the first adds the down projection's bias, the
    other taking its gradient without its value (the norm, which clips, counting it once)."""
    check_equivalent([_family(model="gpt-oss-tiny", dp=2, etp=2)], world_size=2)


@pytest.mark.slow
def test_gpt_oss_at_ep2_by_etp2_trains_as_one_process():
    """Also with the expert groups folded over tp2 under sequence parallelism, and etp2 under ZeRO-3 over edp2."""
    oss = functools.partial(_family, model="gpt-oss-tiny")
    check_equivalent([oss(dp=4, ep=2, etp=2), oss(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True),
                      oss(dp=4, etp=2, zero=3)], world_size=4)


def test_qwen3_moe_and_deepseek_v3_at_etp2_train_as_one_process():
    """DeepSeek-V3's shared experts and dense first layer stay whole on every etp rank."""
    check_equivalent([_family(model="qwen3-moe-tiny", dp=2, etp=2), _family(model="deepseek-v3-tiny", dp=2, etp=2)],
                     world_size=2)


def test_a_checkpoint_of_etp_sharded_experts_reads_back_whole_and_at_another_layout(tmp_path):
    """``gpt-oss-tiny``'s experts: weights and gate/up biases split, the down projection's bias whole on each."""
    name = "gpt-oss-tiny"
    _, saved = run_ranks(train, 2, dict(mesh=dict(etp=2)), tmp_path, name)[0]
    for weights in (restored(dict(mesh={}), tmp_path, name),
                    run_ranks(restored, 2, dict(mesh=dict(tp=2, etp=2, sequence_parallel=True),
                                                sequence_parallel=True), tmp_path, name)[0]):
        assert weights.keys() == saved.keys()
        assert all(weights[key].equal(saved[key]) for key in saved), "a restored weight differs from the saved one"
