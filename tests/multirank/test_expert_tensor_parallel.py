"""Expert tensor parallelism: each routed expert's FFN split over etp ranks (w1 by column, w2 by row), tokens
gathered over them and the partial outputs summed back, trains ``moe-tiny`` in float64 exactly as one process does,
alone, with ZeRO-3, under tp with sequence parallelism, and composed with ep; its full weights come back whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainmesh as tm
from helpers import assert_same_training
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import preset
from trainmesh.models.gpt import GPT

STEPS, BATCH, SEQ, MICRO, LR, MAX_NORM = 3, 8, 16, 2, 3e-3, 0.05


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, preset("moe-tiny").vocab_size, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def build(layout: dict) -> tuple[tm.ParallelModel, tm.Optimizer]:
    """``moe-tiny`` at ``layout`` (``init_mesh`` sizes under ``mesh``, the rest ``parallelize``'s) and its optimizer."""
    layout = dict(layout)
    mesh = tm.init_mesh(**layout.pop("mesh"))
    torch.manual_seed(0)
    model = tm.parallelize(GPT(preset("moe-tiny")), mesh, precision="fp64", microbatches=MICRO, **layout)
    return model, tm.optimizer(model, lr=LR)


def train(layout: dict, save_to: Path | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and full weights of ``moe-tiny`` trained at ``layout``; saved to ``save_to`` if given."""
    model, opt = build(layout)
    losses = [tm.train_step(model, opt, batch, max_norm=MAX_NORM) for batch in batches()]
    if save_to is not None:
        tm.save(model, opt, save_to, STEPS)
    return losses, model.state_dict()


def restored(layout: dict, directory: Path) -> dict[str, torch.Tensor]:
    """The full weights ``moe-tiny`` at ``layout`` holds after loading the checkpoint in ``directory``."""
    model, opt = build(layout)
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


def test_a_checkpoint_of_etp_sharded_experts_reads_back_whole_and_at_another_layout(tmp_path):
    _, saved = run_ranks(train, 2, dict(mesh=dict(etp=2)), tmp_path)[0]
    for weights in (restored(dict(mesh={}), tmp_path),
                    run_ranks(restored, 2, dict(mesh=dict(tp=2, etp=2, sequence_parallel=True),
                                                sequence_parallel=True), tmp_path)[0]):
        assert weights.keys() == saved.keys()
        assert all(weights[name].equal(saved[name]) for name in saved), "a restored weight differs from the saved one"
