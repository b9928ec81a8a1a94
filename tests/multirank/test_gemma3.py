"""Gemma 3 (``gemma3-tiny``: local and global layers alternating, a window of 8 in 32 tokens, 1 + w norms around
attention and MLP, scaled embeddings, GeGLU, a tied head, a softmax scale apart from the head size): a random
``Gemma3ForCausalLM`` written by ``save_pretrained`` gives transformers' logits once imported and once exported
and reloaded (float64, 1e-10 of the logits' scale, transformers' float32 RMSNorm and rotary angles lifted to the
model's dtype); it decodes with the KV cache as without; it trains under tp, cp (ring and a2a) and tp2 x pp2 as one process
does (float64, 1e-9), and at dp2 ZeRO-2 and ZeRO-3 (slow; the tied weight in the head's unit, which the
embedding's forward gathers too); recomputation keeps its losses."""

import dataclasses
import functools

import pytest
import torch
from safetensors.torch import load_file

from helpers import check_equivalent, in_fp64, train
from helpers import config as run_config
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import gemma, hf, preset, spec_of
from trainmesh.models.cache import KVCache
from trainmesh.models.llama import Llama
from trainmesh.models.spec import HFIncompatible

transformers = pytest.importorskip("transformers")
_cfg = functools.partial(run_config, steps=3, global_batch=4, warmup_steps=1)
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
REL = 1e-10


@pytest.fixture
def fp64_gemma(monkeypatch):
    """transformers' Gemma 3 RMSNorm and rotary angles (float32 there, whatever the model's dtype) in float64."""
    from transformers.models.gemma3 import modeling_gemma3 as g

    def rms_norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def rotary(self, x, position_ids, layer_type):
        rope, dim = self.config.rope_parameters[layer_type], self.config.head_dim
        inv_freq = rope["rope_theta"] ** -(torch.arange(0, dim, 2, dtype=x.dtype) / dim) / rope.get("factor", 1.0)
        angles = position_ids[..., None].to(x.dtype) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    monkeypatch.setattr(g.Gemma3RMSNorm, "forward", rms_norm)
    monkeypatch.setattr(g.Gemma3RotaryEmbedding, "forward", rotary)


def save_gemma(directory, **changes):
    """A random float64 Gemma 3: every third layer global (its rope linearly scaled), a window of 4, heads twice
    hidden / heads wide, the softmax scaled by 1/sqrt(24); norm gains away from their 0."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}},
        initializer_range=0.2, **changes)
    model = transformers.Gemma3ForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) - 0.5)
    model.save_pretrained(directory)
    return directory


def hf_logits(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="sdpa")
    with torch.no_grad():
        return model(TOKENS).logits


def assert_same_logits(ours, theirs, what):
    diff, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    assert scale > 1.0, f"{what}: logits of scale {scale} would not show a misplaced weight"
    assert diff <= REL * scale, f"{what}: max |dlogit| {diff:.3e} exceeds {REL:g} x {scale:.2f}"
    print(f"{what}: max |dlogit| {diff:.2e} of scale {scale:.2f}")


def test_gemma3_imports_and_exports_with_transformers_logits(tmp_path, fp64_gemma):
    directory = save_gemma(tmp_path / "hf")
    spec, cfg, ours = hf.read_hf(directory)
    assert spec.family == "gemma3" and (cfg.global_every, cfg.sliding_window, cfg.local_rope_theta) == (3, 4, 1e3)
    saved = load_file(directory / hf.WEIGHTS)
    back = spec.hf.to_hf(cfg, ours)
    assert back.keys() == saved.keys() and all(torch.equal(back[k], saved[k]) for k in saved)
    expected = hf_logits(directory)
    model = hf.load_hf(spec.builder(cfg, 7).double(), directory)
    with torch.no_grad():
        assert_same_logits(model(TOKENS), expected, "gemma3 imported, one process")
        model.blocks["0"].attn.core.window = None  # a local layer attending globally: the window is seen
        assert (model(TOKENS) - expected).abs().max() > 1e-3
        model.blocks["0"].attn.core.window = 4
    out = hf.save_hf(model, tmp_path / "out")
    assert_same_logits(hf_logits(out), expected, "gemma3 exported, reloaded")
    assert spec.hf.from_config(spec.hf.to_config(cfg)) == cfg


@pytest.mark.parametrize("changes", [{"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0},
                                     {"layer_types": ["full_attention", "sliding_attention"] * 2},
                                     {"tie_word_embeddings": False}])
def test_gemma3_configs_trainmesh_does_not_compute_are_refused_in_one_line(changes):
    hf_config = transformers.Gemma3TextConfig(num_hidden_layers=4, **changes).to_dict()
    with pytest.raises(HFIncompatible, match="cannot be imported"):
        gemma.from_hf_config(hf_config)


def test_gemma3_decodes_past_its_window_with_the_kv_cache_as_without():
    model = Llama(preset("gemma3-tiny"), seed=1).double()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole, cache = model(tokens), KVCache(model, 20)
        steps = [model(tokens[:, :12], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(12, 20)]
        stepped = torch.cat(steps, dim=1)
        assert (stepped - whole).abs().max() <= 1e-12
        everywhere = Llama(dataclasses.replace(preset("gemma3-tiny"), sliding_window=None), seed=1).double()
        assert (everywhere(tokens) - whole).abs().max() > 1e-6


def test_gemma3_tp2_sp_and_cp2_match_single_process():
    assert spec_of("gemma3-tiny").family == "gemma3"
    check_equivalent([_cfg(model="gemma3-tiny", tp=2, sequence_parallel=True), _cfg(model="gemma3-tiny", cp=2),
                      _cfg(model="gemma3-tiny", cp=2, cp_impl="a2a")], world_size=2)


def test_gemma3_tp2_pp2_matches_single_process():
    check_equivalent([_cfg(model="gemma3-tiny", tp=2, pp=2, microbatches=2)], world_size=4)


@pytest.mark.slow
def test_gemma3_dp2_zero2_and_zero3_matches_single_process():
    check_equivalent([_cfg(model="gemma3-tiny", dp=2, zero=2), _cfg(model="gemma3-tiny", dp=2, zero=3)], world_size=2)


def test_gemma3_recompute_keeps_its_losses():
    runs = {mode: train(in_fp64(_cfg(model="gemma3-tiny", recompute=mode, steps=2)),
                        mesh=Mesh.build(1, 1, 1, torch.device("cpu"))) for mode in ("none", "selective", "full")}
    for mode in ("selective", "full"):
        assert max(abs(a - b) for a, b in zip(runs["none"].losses, runs[mode].losses)) <= 1e-12, mode
