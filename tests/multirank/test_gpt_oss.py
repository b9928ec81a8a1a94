"""GPT-OSS as options of trainmesh's Llama: a random ``GptOssForCausalLM`` (sinks, q/k/v/o biases, sliding and
full layers alternating, YaRN, biased router, biased experts whose clamped SwiGLU clamps) written by
``save_pretrained`` gives transformers' own logits once imported and once exported and reloaded (float64, within
1e-10 of the logits' scale; transformers' RMSNorm, YaRN and rotary float32 casts made float64); ``gpt-oss-tiny``
trains at tp2, dp2 ep2 and tp2 x pp2 (with SP) as one process does (float64, 1e-9), and in the slow set under
ZeRO-3, ep folded over tp, selective and full recomputation; decoding with the KV cache past the 8-token window
gives the full forward's logits; cp2 ring (the sinks applied to the merged output by its lse) and cp2 a2a (the
sinks cut to each rank's heads) train as one process does, and tp2 x cp2 ring in the slow set."""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch

from helpers import check_equivalent
from helpers import config as run_config
from trainmesh.models import hf, planner_shapes, preset
from trainmesh.models.cache import KVCache
from trainmesh.models.llama import Llama
from trainmesh.plan.memory import active_params
from trainmesh.models.gpt_oss import from_hf_config

transformers = pytest.importorskip("transformers")

REL = 1e-10
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
LIMIT = 0.5  # low enough that the random experts' gates and ups are clamped


@pytest.fixture
def fp64_gpt_oss(monkeypatch):
    """transformers' GPT-OSS RMSNorm and its YaRN rotary angles (its own rope function) in float64."""
    from transformers import modeling_rope_utils
    from transformers.models.gpt_oss import modeling_gpt_oss as mg

    in_float64 = types.SimpleNamespace(**{**vars(torch), "float": torch.float64, "float32": torch.float64})

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(modeling_rope_utils, "torch", in_float64)
            inv_freq, factor = modeling_rope_utils.ROPE_INIT_FUNCTIONS[self.rope_type](self.config)
        angles = position_ids[..., None].to(x.dtype) * inv_freq.to(x.dtype)
        return angles.cos() * factor, angles.sin() * factor

    monkeypatch.setattr(mg.GptOssRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(mg.GptOssRotaryEmbedding, "forward", rotary)


def save_hf_gpt_oss(directory) -> None:
    """A random float64 GPT-OSS (hidden 64, 4 layers, 4 heads of 16, 2 KV heads, window 4, 4 experts top-2)."""
    cfg = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, swiglu_limit=LIMIT, initializer_range=0.2, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, truncate=False))
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # gains, biases and sinks away from HF's 1/0 init, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)
    model.save_pretrained(directory)


def hf_logits(directory) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager",
                                                              experts_implementation="eager")
    with torch.no_grad():
        return model(TOKENS).logits


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    diff, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    assert scale > 1.0, f"{what}: logits of scale {scale} would not show a misplaced weight"
    assert diff <= REL * scale, f"{what}: max |dlogit| {diff:.3e} exceeds {REL:g} x {scale:.2f}"
    return diff


def test_gpt_oss_imports_and_exports_with_transformers_logits(tmp_path, fp64_gpt_oss):
    save_hf_gpt_oss(tmp_path / "hf")
    expected = hf_logits(tmp_path / "hf")
    model = hf.from_hf(tmp_path / "hf")
    cfg = model.cfg
    assert cfg.attention_sinks and cfg.alternate_window and cfg.moe.biases and cfg.moe.swiglu_limit == LIMIT
    assert [model.blocks[str(i)].attn.core.window for i in range(4)] == [4, None, 4, None]
    with torch.no_grad():
        assert_same_logits(model(TOKENS), expected, "gpt-oss imported")
        hf.save_hf(model, tmp_path / "out")
        assert_same_logits(hf_logits(tmp_path / "out"), expected, "gpt-oss exported")
        unclamped = Llama(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, swiglu_limit=100.0)))
        unclamped.to(torch.float64).load_state_dict(model.state_dict())
        assert (unclamped(TOKENS) - expected).abs().max() > 1e-3  # the clamp binds in this model


def test_layer_types_other_than_alternating_are_refused():
    hf_config = transformers.GptOssConfig(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        from_hf_config(hf_config.to_dict())


_case = functools.partial(run_config, model="gpt-oss-tiny", steps=3, global_batch=4, warmup_steps=1)


def test_gpt_oss_trains_at_tp2_and_ep2_as_one_process():
    check_equivalent([_case(tp=2), _case(dp=2, ep=2)], world_size=2)


def test_gpt_oss_trains_at_tp2_pp2_as_one_process():
    check_equivalent([_case(tp=2, pp=2, microbatches=2), _case(tp=2, pp=2, microbatches=2, sequence_parallel=True)],
                     world_size=4)


@pytest.mark.slow
def test_gpt_oss_trains_under_zero3_ep_over_tp_and_recompute_as_one_process():
    check_equivalent([_case(dp=2, zero=3), _case(tp=2, ep=2, sequence_parallel=True),
                      _case(tp=2, recompute="selective"), _case(dp=2, ep=2, zero=1, recompute="full")], world_size=2)


def test_gpt_oss_decodes_past_its_window_with_the_kv_cache_as_without():
    model = Llama(preset("gpt-oss-tiny"), seed=1).double()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, cache = model(tokens), KVCache(model, tokens.shape[1])
        steps = [model(tokens[:, :5], cache)] + [model(tokens[:, t:t + 1], cache) for t in range(5, tokens.shape[1])]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-12


def test_gpt_oss_trains_at_cp2_ring_and_a2a_as_one_process():
    """The ring scales each query's merged output by sigmoid(lse - sink), lse's gradient folded into its backward;
    a2a runs the core on whole sequences for half the heads, with those heads' sinks (windowed layers in both)."""
    check_equivalent([_case(cp=2), _case(cp=2, cp_impl="a2a")], world_size=2)


@pytest.mark.slow
def test_gpt_oss_trains_at_tp2_cp2_ring_as_one_process():
    """tp keeps two heads' sinks, the ring applies them (a2a at tp2 x cp2 is refused: 2 KV heads over 4 ranks)."""
    check_equivalent([_case(tp=2, cp=2), _case(tp=2, cp=2, sequence_parallel=True)], world_size=4)


def test_the_planner_counts_gpt_oss_20b_as_published():
    """openai/gpt-oss-20b's model card: 20.91B parameters, 3.61B active per token without the embedding."""
    shape = planner_shapes()["gpt-oss-20b"]
    embedding = shape.vocab_size * shape.d_model
    assert abs(shape.n_params() / 20.91e9 - 1) < 1e-3 and abs((active_params(shape) - embedding) / 3.61e9 - 1) < 1e-2
