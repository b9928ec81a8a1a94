"""A Qwen2 whose output head shares the embedding's weight (its small sizes are tied) trains in float64 at tp2,
pp2 (the first and last stage each holding the weight, their gradients summed) and composed layouts exactly as
one process does, through the public API, and its tied weight stays one."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import safetensors
import torch

import trainmesh as tm
from helpers import assert_same_training
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import preset
from trainmesh.models.llama import Llama

CFG = dataclasses.replace(preset("qwen2-tiny"), tie_embeddings=True)
STEPS, BATCH, SEQ, MICRO, LR, MAX_NORM = 4, 8, 16, 2, 3e-3, 0.05


def hf_qwen2() -> torch.nn.Module:
    """The tied model held in transformers' classes (presented by the Qwen2 family's stage layout)."""
    import transformers
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=CFG.vocab_size, tie_word_embeddings=True)).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(layout: dict) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor | None]:
    """Train the tied model at ``layout`` (``init_mesh`` sizes and ``parallelize`` settings); losses, full weights
    and this rank's copy of the tied weight (None on a middle stage)."""
    layout = dict(layout)
    mesh = tm.init_mesh(**layout.pop("mesh"))
    plain = hf_qwen2() if layout.pop("hf", False) else Llama(CFG)
    model = tm.parallelize(plain, mesh, precision="fp64", microbatches=MICRO, **layout)
    opt = tm.optimizer(model, lr=LR)
    losses = [tm.train_step(model, opt, batch, max_norm=MAX_NORM) for batch in batches()]
    part = model.module
    if part.head is not None:
        assert part.head.weight is part.embed.weight, "the head's weight is not the embedding's"
    with model.engine.gathered():  # ZeRO-3 holds shards between steps
        mine = None if part.embed is None else part.embed.weight.detach().clone()
    return losses, model.state_dict(), mine


def train_layouts(layouts: list[dict]) -> list:
    torch.set_num_threads(1)
    return [train(layout) for layout in layouts]


def assert_layouts_match_one_process(layouts: list[dict], world: int) -> None:
    """Each layout's losses and full weights within FP64_ATOL of one process's, and every rank's copy of the
    tied weight (both pipeline ends, every dp/tp coordinate) equal to the others of its tp coordinate."""
    reference = train(dict(mesh={}, hf=layouts[0].get("hf", False)))[:2]
    per_rank = run_ranks(train_layouts, world, layouts, timeout=300)
    for i, layout in enumerate(layouts):
        loss, param = assert_same_training(reference, per_rank[0][i][:2])
        print(f"tied qwen2 {layout}: |dloss| {loss:.1e} |dparam| {param:.1e}")
        sizes = layout["mesh"]  # global rank r is tp coordinate r % tp
        held = [ranks[i][2] for r, ranks in enumerate(per_rank)
                if ranks[i][2] is not None and r % sizes.get("tp", 1) == 0]
        assert len(held) == sizes.get("dp", 1) * min(2, sizes.get("pp", 1)), f"{layout}: {len(held)} copies"
        assert all(c.equal(held[0]) for c in held), f"{layout}: the copies of the tied weight differ"


def test_tied_qwen2_at_tp2_and_pp2_trains_as_one_process():
    assert_layouts_match_one_process([dict(mesh=dict(tp=2)), dict(mesh=dict(pp=2))], world=2)


def test_tied_qwen2_at_dp2_zero3_trains_as_one_process():
    """One stage: the head's ZeRO-3 unit owns the weight, the embedding's forward gathers that unit too."""
    assert_layouts_match_one_process([dict(mesh=dict(dp=2), zero=3)], world=2)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(zero=1), dict(zero=2), dict(zero=3), dict(schedule="zb"),
                                      dict(schedule="interleaved", virtual_stages=2), dict(schedule="gpipe")],
                         ids=["zero1", "zero2", "zero3", "zb", "interleaved", "gpipe"])
def test_tied_qwen2_at_pp2_with_zero_and_every_schedule_trains_as_one_process(settings):
    assert_layouts_match_one_process([dict(mesh=dict(pp=2), **settings)], world=2)


@pytest.mark.slow
def test_tied_qwen2_at_four_ranks_trains_as_one_process():
    assert_layouts_match_one_process([dict(mesh=dict(dp=2, pp=2), zero=1), dict(mesh=dict(dp=2, pp=2), zero=3),
                                      dict(mesh=dict(tp=2, pp=2), sequence_parallel=True), dict(mesh=dict(pp=4))],
                                     world=4)


def save_at_pp2_and_resume(directory: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train two steps at pp2 and save; a fresh pp2 model loads it. Both full state dicts."""
    torch.set_num_threads(1)
    model = tm.parallelize(Llama(CFG), tm.init_mesh(pp=2), precision="fp64", microbatches=MICRO)
    opt = tm.optimizer(model, lr=LR)
    for batch in batches()[:2]:
        tm.train_step(model, opt, batch, max_norm=MAX_NORM)
    tm.save(model, opt, directory, step=2)
    resumed = tm.parallelize(Llama(CFG, seed=5), tm.init_mesh(pp=2), precision="fp64", microbatches=MICRO)
    tm.load(resumed, tm.optimizer(resumed, lr=LR), directory)
    return model.state_dict(), resumed.state_dict()


def test_a_pp2_checkpoint_of_a_tied_qwen2_holds_one_weight_loads_anywhere_and_exports_tied(tmp_path):
    saved, resumed = run_ranks(save_at_pp2_and_resume, 2, str(tmp_path / "ckpt"), timeout=240)[0]
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-*/manifest.json")).read_text())
    assert "model/embed.weight" in manifest["tensors"] and "model/head.weight" not in manifest["tensors"]
    one = tm.parallelize(Llama(CFG, seed=5), tm.init_mesh(), precision="fp64")
    tm.load(one, tm.optimizer(one, lr=LR), tmp_path / "ckpt")
    assert one.module.head.weight is one.module.embed.weight
    for state in (resumed, one.state_dict()):
        assert state.keys() == saved.keys() and all(state[k].equal(saved[k]) for k in saved)
    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "trainmesh", "export", str(tmp_path / "ckpt"), "--hf", str(out)], check=True)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safetensors.safe_open(out / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").equal(saved["embed.weight"])


@pytest.mark.slow
def test_a_tied_qwen2_held_in_transformers_classes_at_tp2_and_pp2_zero3_trains_as_one_process():
    assert_layouts_match_one_process([dict(mesh=dict(tp=2), hf=True), dict(mesh=dict(pp=2), zero=3, hf=True)], world=2)
