"""Qwen2, Qwen3, Mistral, Qwen3-MoE and DeepSeek-V3 train under every parallel form as one process does
(float64, 1e-9), Mistral's sliding window holding under tp, the cp ring and all-to-all and in the KV cache,
Qwen3's heads (twice d_model / n_heads wide in ``qwen3-tiny``) under tp, cp and pp, MoE models with dense first
layers at pp2 (a stage without experts); a checkpoint saved at one layout resumes at
another. The smallest layouts run by default, the rest in the slow set."""

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

import trainmesh as tm
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import preset, spec_of
from trainmesh.models.cache import KVCache, causal_attention
from trainmesh.models.llama import Llama
from trainmesh.parallel.context_parallel import blockwise_attention, chunk_starts, local_positions
from trainmesh.distributed.testing import run_ranks

from helpers import (EQUIVALENCE_TABLE, FP64_ATOL, Case, assert_same_training, build, check_equivalent, in_fp64, train,
                     train_and_save)
from helpers import config as run_config

_cfg = functools.partial(run_config, steps=3, global_batch=4, warmup_steps=1)
FAMILIES = ["qwen2-tiny", "qwen3-tiny", "mistral-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"]


@pytest.mark.parametrize("name", [n if n in ("qwen3-tiny", "deepseek-v3-tiny") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FAMILIES])
def test_recompute_keeps_each_familys_losses(name):
    runs = {mode: train(in_fp64(_cfg(model=name, recompute=mode, steps=2)), mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
            for mode in ("none", "selective", "full")}
    for mode in ("selective", "full"):
        assert max(abs(a - b) for a, b in zip(runs["none"].losses, runs[mode].losses)) <= 1e-12, mode


def test_family_presets_are_llama_options():
    assert {spec_of(n).family for n in ("qwen2-tiny", "qwen3-tiny", "mistral-tiny")} == {"qwen2", "qwen3", "mistral"}
    assert preset("qwen2-tiny").qkv_bias and preset("qwen3-tiny").qk_norm and preset("mistral-tiny").sliding_window
    qwen3 = Llama(preset("qwen3-tiny"))
    # Heads of 32, twice d_model / n_heads, as Qwen3-0.6B's: queries 128 wide, ``o`` back to 64.
    assert qwen3.blocks["0"].attn.q_norm.weight.shape == (32,) and qwen3.blocks["0"].attn.qkv.bias is None
    assert qwen3.blocks["0"].attn.qkv.weight.shape == (256, 64) and qwen3.blocks["0"].attn.o.weight.shape == (64, 128)
    assert Llama(preset("qwen2-tiny")).blocks["0"].attn.qkv.bias.abs().sum() == 0


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_a_sliding_window_holds_in_the_rings_blockwise_merge(cp):
    """Each cp rank's head-tail queries over every rank's key/value block, masked by global position and
    pairs wholly outside the window skipped, against one masked attention, forward and backward."""
    seq, window = 48, 5
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    grad = torch.randn(2, 4, seq, 8, generator=gen, dtype=torch.float64)
    ref = causal_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), window)
    held = [local_positions(seq, cp, r) for r in range(cp)]
    starts = [chunk_starts(seq, cp, r) for r in range(cp)]
    parts = [blockwise_attention(q[:, :, idx], [k[:, :, i] for i in held], [v[:, :, i] for i in held], starts[r],
                                 starts, window=window) for r, idx in enumerate(held)]
    out = torch.cat(parts, 2).index_select(2, torch.argsort(torch.cat(held)))
    assert (out - ref).abs().max() < 1e-12
    for g, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert (g - r).abs().max() < 1e-12


def _full_and_cached(model: Llama, tokens: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one full forward, and the same positions decoded with the KV cache: ``prefill`` tokens,
    then one at a time."""
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model, tokens.shape[1])
        steps = [model(tokens[:, :prefill], cache)]
        steps += [model(tokens[:, t:t + 1], cache) for t in range(prefill, tokens.shape[1])]
    return full, torch.cat(steps, 1)


def test_mistral_decodes_past_its_window_with_the_kv_cache_as_without():
    """Prefill 5 tokens, then one at a time to 24 (three windows of 8): each step's logits are the full
    forward's at that position."""
    model = Llama(preset("mistral-tiny"), seed=1).double()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    full, stepped = _full_and_cached(model, tokens, prefill=5)
    assert (stepped - full).abs().max() < 1e-12
    no_window = Llama(dataclasses.replace(preset("mistral-tiny"), sliding_window=None), seed=1).double()
    with torch.no_grad():
        assert (no_window(tokens) - full)[:, 8:].abs().max() > 1e-3  # the window changes what is seen


def test_qwen2_dp2_qwen3_tp2_sp_mistral_cp2_ring_and_a2a_qwen3_moe_ep2_and_deepseek_tp2_sp_ep2_match_single_process():
    """DeepSeek-V3's group-limited routing (``deepseek-v3-tiny``: 2 of 4 groups) included, under tp and ep."""
    check_equivalent([_cfg(model="qwen2-tiny", dp=2), _cfg(model="qwen3-tiny", tp=2, sequence_parallel=True),
                      _cfg(model="mistral-tiny", cp=2), _cfg(model="mistral-tiny", cp=2, cp_impl="a2a"),
                      _cfg(model="qwen3-moe-tiny", dp=2, ep=2),
                      _cfg(model="deepseek-v3-tiny", tp=2, sequence_parallel=True),
                      _cfg(model="deepseek-v3-tiny", dp=2, ep=2)], world_size=2)


@pytest.mark.slow
def test_every_family_at_dp2_zero3_tp2_sp_pp2_and_cp2_matches_single_process():
    layouts = [dict(dp=2), dict(dp=2, zero=3), dict(tp=2), dict(tp=2, sequence_parallel=True),
               dict(pp=2, microbatches=2), dict(cp=2), dict(cp=2, cp_impl="a2a")]
    check_equivalent([_cfg(model=m, **layout) for m in ("qwen2-tiny", "qwen3-tiny", "mistral-tiny")
                      for layout in layouts], world_size=2, timeout=600)


@pytest.mark.slow
def test_qwen3_moe_at_tp2_sp_pp2_cp2_and_ep2_zero1_matches_single_process():
    check_equivalent([_cfg(model="qwen3-moe-tiny", **layout) for layout in (
        dict(tp=2, sequence_parallel=True), dict(pp=2, microbatches=2), dict(cp=2), dict(dp=2, ep=2, zero=1))],
        world_size=2, timeout=600)


def test_deepseek_v3_at_pp2_with_a_stage_of_only_its_dense_layer_matches_single_process():
    """Stage 0 holds only the dense first layer, no routed experts, yet joins the experts' gradient-norm
    all-reduce over pp that stage 1 enters (adding zero); skipping it, as it once did, both stages hang."""
    check_equivalent([_cfg(model="deepseek-v3-tiny", pp=2, microbatches=2)], world_size=2, timeout=60)


@pytest.mark.slow
def test_deepseek_v3_at_pp2_with_tp2_sp_dp2_ep2_zero1_and_zero3_matches_single_process():
    check_equivalent([_cfg(model="deepseek-v3-tiny", pp=2, microbatches=2, **layout) for layout in (
        dict(tp=2, sequence_parallel=True), dict(dp=2, ep=2), dict(dp=2, zero=1), dict(dp=2, zero=3))],
        world_size=4, timeout=600)


MAX_NORM = 0.05  # below every step's gradient norm, so each step is clipped by the whole model's norm


@dataclasses.dataclass(frozen=True)
class DenseFirst:
    """A tiny MoE preset remade with ``n_layers`` layers, the first ``dense`` of them dense, and the pipeline
    schedule it is trained with at pp2."""
    preset: str
    n_layers: int
    dense: int
    schedule: str = "1f1b"
    virtual_stages: int = 1

    def model(self) -> Llama:
        cfg = preset(self.preset)
        cfg = dataclasses.replace(cfg, n_layers=self.n_layers, moe=dataclasses.replace(cfg.moe, n_dense_layers=self.dense))
        return Llama(cfg, seed=0).double()


def _train_through_the_api(case: DenseFirst, pp: int) -> tuple[tuple[list[float], dict[str, torch.Tensor]], list[float]]:
    """Three steps of ``case``'s model through ``trainmesh.parallelize`` at ``pp`` stages (one process at 1):
    the losses and final parameters, and each step's gradient norm."""
    torch.set_num_threads(1)
    mesh = tm.init_mesh(pp=pp) if pp > 1 else Mesh.build(1, 1, 1, torch.device("cpu"))
    layout = dict(schedule=case.schedule, virtual_stages=case.virtual_stages) if pp > 1 else {}
    model = tm.parallelize(case.model(), mesh, precision="fp64", microbatches=2, **layout)
    opt = tm.optimizer(model, lr=3e-3)
    tokens = torch.randint(0, 256, (3, 4, 33), generator=torch.Generator().manual_seed(1))
    losses, norms = [], []
    for t in tokens:
        losses.append(tm.train_step(model, opt, (t[:, :-1], t[:, 1:]), max_norm=MAX_NORM))
        norms.append(opt.grad_norm)
    return (losses, model.state_dict()), norms


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    DenseFirst("qwen3-moe-tiny", 2, 1),
    *(DenseFirst("deepseek-v3-tiny", 4, 3, schedule) for schedule in ("gpipe", "zb")),
    DenseFirst("deepseek-v3-tiny", 4, 3, "interleaved", 2)], ids=lambda case: f"{case.preset}-{case.schedule}")
def test_an_moe_with_dense_first_layers_at_pp2_matches_one_process(case):
    """Through the API, as a user builds the model: a rank holds dense layers only (stage 0; interleaved,
    layers 0 and 2 of DeepSeek-V3's three dense of four), the other the experts; both clip by the norm of all."""
    (reference, ref_norms), (parallel, norms) = _train_through_the_api(case, 1), run_ranks(
        _train_through_the_api, 2, case, 2, timeout=120)[0]
    assert min(ref_norms) > MAX_NORM and max(abs(a - b) for a, b in zip(norms, ref_norms)) <= FP64_ATOL
    EQUIVALENCE_TABLE.append((f"pp2 {case.schedule} mb2 api {case.preset} {case.n_layers} layers {case.dense} dense",
                              *assert_same_training(reference, parallel)))


@pytest.mark.slow
def test_deepseek_v3_at_tp2_dp2_ep2_zero3_matches_single_process():
    check_equivalent([_cfg(model="deepseek-v3-tiny", **layout) for layout in (
        dict(tp=2), dict(dp=2, ep=2), dict(dp=2, zero=3))], world_size=2, timeout=600)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_decodes_with_the_kv_cache_as_without(name):
    model = Llama(preset(name), seed=1).double()
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    full, stepped = _full_and_cached(model, tokens, prefill=4)
    assert (stepped - full).abs().max() < 1e-12


@pytest.mark.slow
def test_families_at_tp2_cp2_and_dp2_pp2_match_single_process():
    check_equivalent([_cfg(model=m, tp=2, cp=2, sequence_parallel=True) for m in ("qwen3-tiny", "mistral-tiny")]
                     + [_cfg(model="qwen2-tiny", dp=2, pp=2, microbatches=2)], world_size=4, timeout=600)


def _resumes_in_one_process_exactly(cfg: Case, directory: Path) -> None:
    """Two steps of ``cfg`` saved by its two ranks in ``directory``, read back by one process: every tensor equal."""
    trained = run_ranks(train_and_save, 2, cfg, str(directory), timeout=120)[0]
    single = dataclasses.replace(cfg, dp=1, tp=1, cp=1, pp=1, ep=1, sequence_parallel=False, microbatches=1, steps=3)
    run = build(single, Mesh.build(1, 1, 1, torch.device("cpu")))
    assert tm.load(run.parallel, run.opt, directory) == 2
    loaded = run.parallel.state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], t) for k, t in trained.items())


def test_a_mistral_checkpoint_saved_at_cp2_resumes_in_one_process_exactly(tmp_path):
    """Saved by two cp ranks (the window kept by the ring)."""
    _resumes_in_one_process_exactly(dataclasses.replace(_cfg(model="mistral-tiny", cp=2, precision="fp64"), steps=2),
                                    tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [pytest.param(name, layout, id=name) for name, layout in (
    ("qwen2-tiny", dict(tp=2, sequence_parallel=True)), ("qwen3-tiny", dict(pp=2, microbatches=2)),
    ("qwen3-moe-tiny", dict(dp=2, ep=2)), ("gemma3-tiny", dict(pp=2, microbatches=2)),
    ("gpt-oss-tiny", dict(tp=2, sequence_parallel=True)))])
def test_each_familys_checkpoint_saved_at_two_ranks_resumes_in_one_process_exactly(tmp_path, name, layout):
    """Saved across two ranks of tp (Qwen2's q/k/v biases split; GPT-OSS's sinks), pp (Qwen3; Gemma 3's tied
    embedding on both stages) or ep (Qwen3-MoE's experts)."""
    _resumes_in_one_process_exactly(dataclasses.replace(_cfg(model=name, precision="fp64", **layout), steps=2),
                                    tmp_path)


@pytest.mark.slow
def test_a_deepseek_v3_checkpoint_saved_at_pp2_resumes_in_one_process_exactly(tmp_path):
    """Saved by two pipeline stages, the first without experts, the second with their routing bias."""
    _resumes_in_one_process_exactly(dataclasses.replace(
        _cfg(model="deepseek-v3-tiny", pp=2, microbatches=2, precision="fp64"), steps=2), tmp_path)
