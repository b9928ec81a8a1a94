"""Any shape: the planner's parameter counts against the modules that hold the parameters (transformers'
model of each HF model type it reads, trainmesh's own families) and against published totals; the custom
shape flags; latent attention's key/value traffic."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

from trainmesh.app import cli
from trainmesh.app.config import config_from_args
from trainmesh.app.planning import add_plan_arguments, layout_of, plan_from_args, workload_of
from trainmesh.models import SPECS, preset
from trainmesh.models.llama import Llama
from trainmesh.plan import Layout, Workload, active_params, cp_bytes_per_micro, model_shape
from trainmesh.plan.flops import block_forward_flops
from trainmesh.plan.memory import params_per_tp_rank
from trainmesh.plan.timing import model_flops_per_token
from trainmesh.plan.hf_shape import READERS, read_hf_shape, shape_of_hf_config

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)
TINY_HF = {  # model_type -> (transformers config class, its fields): small, every variant switched on
    "llama": ("LlamaConfig", BASE),
    "mistral": ("MistralConfig", {**BASE, "sliding_window": 16, "head_dim": 8}),  # heads narrower than 64 / 4
    "qwen2": ("Qwen2Config", BASE),
    "qwen3": ("Qwen3Config", {**BASE, "head_dim": 32}),  # and wider, as Qwen3-0.6B's
    "mixtral": ("MixtralConfig", {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {**BASE, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}),
    "deepseek_v3": ("DeepseekV3Config", {**BASE, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                         "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 1, "topk_group": 1}),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=128, n_positions=64)),
    # read through the family's own mapping, as --init-hf reads them
    "gemma3_text": ("Gemma3TextConfig", {**BASE, "head_dim": 16, "sliding_window": 16}),
    "gpt_oss": ("GptOssConfig", {**BASE, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 8}),
}


def test_every_model_type_the_reader_takes_has_a_tiny_case() -> None:
    assert TINY_HF.keys() == READERS.keys() | {s.hf.model_type for s in SPECS if s.hf}


@pytest.mark.parametrize("model_type,tied", [(kind, tied) for kind in TINY_HF for tied in (False, True)
                                             if (kind, tied) != ("gemma3_text", False)])  # refused: below
def test_the_planners_count_is_the_transformers_models_parameter_count(model_type: str, tied: bool,
                                                                      tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cls, fields = TINY_HF[model_type]
    config = getattr(transformers, cls)(**fields, tie_word_embeddings=tied)
    built = transformers.AutoModelForCausalLM.from_config(config)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert read_hf_shape(tmp_path).n_params() == sum(p.numel() for p in built.parameters())



def test_an_untied_gemma3_config_is_refused_in_one_line_as_init_hf_refuses_it() -> None:
    """trainmesh's Gemma 3 ties its head, so the planner does not price an untied one as tied."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(**TINY_HF["gemma3_text"][1], tie_word_embeddings=False).to_dict()
    with pytest.raises(ValueError, match="^config.json: tie_word_embeddings is false; trainmesh's Gemma 3 ties"):
        shape_of_hf_config(config)

@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.family)
def test_the_planners_count_is_trainmeshs_built_modules_for_every_family(spec) -> None:
    """Every preset small enough to build in a moment (up to 20M parameters; the larger ones are these
    shapes widened)."""
    for name, cfg in spec.presets.items():
        if spec.shape(cfg).n_params() > 20e6:
            continue
        assert spec.shape(cfg).n_params() == sum(p.numel() for p in spec.builder(cfg, 0).parameters()), name


@pytest.mark.parametrize("name,total,active,active_bound", [
    ("llama3-8b", 8.03e9, None, 0), ("llama3-70b", 70.6e9, None, 0), ("llama3-405b", 405.9e9, None, 0),
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01), ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),
    # "37B activated" is given to two figures (36.5-37.5B); the planner's 37.55B counts the input embedding.
    ("deepseek-v3", 671e9, 37e9, 0.02),
])
def test_large_presets_have_their_published_totals(name: str, total: float, active: float | None,
                                                   active_bound: float) -> None:
    """Llama 3 (Meta, 2024, Table 3 and the model cards), Mixtral of Experts (Jiang et al., 2024), the Qwen3
    technical report (2025, its 30.5B / 3.3B, heads of 128 at d 2048) and the DeepSeek-V3 report (arXiv
    2412.19437): within 1 %."""
    m = model_shape(name)
    assert m.n_params() == pytest.approx(total, rel=0.01)
    if active is not None:
        assert active_params(m) == pytest.approx(active, rel=active_bound)


def _plan(argv: str) -> list[str]:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return plan_from_args(parser.parse_args(argv.split())).splitlines()


def test_custom_flags_describe_a_llama_2_13b_and_an_moe_with_latent_attention() -> None:
    """The issue's case: 40 x 5120 with a 13824 SwiGLU MLP is Llama 2 13B (13.0B), not 10.2B of GELU."""
    lines = _plan("--layers 40 --hidden 5120 --heads 40 --ffn 13824 --vocab 32000 --seq 4096 --mlp swiglu "
                  "--gpus 8 --gpu h100-80gb --global-batch 8 --top 1")
    assert lines[0].startswith("13.0B params")
    moe = ("--layers 4 --hidden 256 --heads 8 --ffn 512 --vocab 1024 --seq 128 --mlp swiglu --tied --experts 8 "
           "--top-k 2 --expert-ffn 128 --shared-experts 1 --dense-layers 1 --kv-lora-rank 64 --q-lora-rank 96 "
           "--qk-rope-dim 16 --qk-nope-dim 32 --v-head-dim 32 --gpus 2 --gpu cpu --global-batch 4 --top 1")
    lines = _plan(moe)
    hf = {"model_type": "deepseek_v3", "hidden_size": 256, "num_attention_heads": 8, "num_hidden_layers": 4,
          "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 128, "tie_word_embeddings": True,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1,
          "first_k_dense_replace": 1, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16,
          "qk_nope_head_dim": 32, "v_head_dim": 32}
    shape = shape_of_hf_config(hf)
    assert lines[0].startswith(f"{shape.n_params() / 1e6:.1f}M ({active_params(shape) / 1e6:.1f}M active) params")
    assert (shape.expert_groups, shape.groups_per_token) == (0, 0)  # no n_group: routing unlimited
    limited = shape_of_hf_config({**hf, "n_group": 4, "topk_group": 2})
    assert (limited.expert_groups, limited.groups_per_token) == (4, 2)
    assert dataclasses.replace(limited, expert_groups=0, groups_per_token=0) == shape
    assert lines[-2].startswith("# this custom shape is a shape only the planner knows")


def test_plan_reads_an_hf_config_and_refuses_remote_code_in_one_line(tmp_path: Path) -> None:
    cfg = {"model_type": "llama", **BASE}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lines = _plan(f"--hf-config {tmp_path} --gpus 2 --gpu cpu --global-batch 4 --top 1")
    assert lines[0].startswith(f"{read_hf_shape(tmp_path).n_params() / 1e3:.1f}K params, batch 4 x 64")
    assert "a config without weights" in lines[-2] and "--init-hf" not in lines[-1]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(ValueError, match=r"names remote code \(auto_map\), which trainmesh never runs"):
        read_hf_shape(tmp_path)
    with pytest.raises(ValueError, match="model_type 'bert'; the planner reads llama, mistral"):
        shape_of_hf_config({"model_type": "bert"})


def test_latent_attention_is_priced_over_cp_as_the_ring_sends_it() -> None:
    """The ring passes each head's expanded key (nope + rope dims) and its value (v_head_dim), not the
    compressed latent: DeepSeek-V3's 128 heads of 192 + 128 per token, split over tp."""
    m = model_shape("deepseek-v3")
    work = Workload(m, 8, 32768, "bf16")
    tokens = 32768 // 4
    for tp in (1, 2):
        sent = cp_bytes_per_micro(work, Layout(dp=2, cp=4, tp=tp, microbatches=4))
        assert sent["ring_kv"] == m.n_layers * 3 * tokens * 128 * (128 + 64 + 128) // tp * 2


def test_init_hf_plans_the_directory_and_the_command_starts_from_its_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).save_pretrained(tmp_path)
    lines = _plan(f"--init-hf {tmp_path} --gpus 2 --gpu cpu --global-batch 4 --top 1")
    words = shlex.split(lines[-1])
    assert words[words.index("--init-hf") + 1] == str(tmp_path) and words[words.index("--seq-len") + 1] == "64"
    cfg = config_from_args(cli._parser().parse_args(words[1:]))
    assert workload_of(cfg).model.n_params() == read_hf_shape(tmp_path).n_params()
    assert layout_of(cfg).world == 2


@pytest.mark.parametrize("head_dim", [8, 32])
def test_heads_apart_from_hidden_over_heads_are_counted_as_the_built_block_holds_and_computes(head_dim: int) -> None:
    """Mistral-Nemo's narrower and Qwen3's wider heads: the planner's parameters per tp rank (q/k/v split
    by heads, ``o`` taking n_heads * head_dim in) are the built model's, and a block's forward FLOPs are 2 per
    weight of its matmuls plus QK^T and AV over n_heads * head_dim (the runtime's MFU counts the same)."""
    cfg = dataclasses.replace(preset("llama-tiny"), head_dim=head_dim)
    shape, model, seq = cfg.shape(), Llama(cfg), cfg.seq_len
    attn = model.blocks["0"].attn
    assert attn.qkv.weight.shape == ((4 + 2 * 2) * head_dim, 64) and attn.o.weight.shape == (64, 4 * head_dim)
    assert params_per_tp_rank(shape, 1) == shape.n_params() == sum(p.numel() for p in model.parameters())
    split = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert params_per_tp_rank(shape, 2) == shape.n_params() - split // 2
    matmuls = sum(m.weight.numel() for m in model.blocks["0"].modules() if isinstance(m, torch.nn.Linear))
    assert block_forward_flops(shape, seq) == 2 * matmuls + 4 * seq * 4 * head_dim
    assert model_flops_per_token(shape) == 3 * (cfg.n_layers * block_forward_flops(shape, seq)
                                                + 2 * 64 * cfg.vocab_size)


def test_plan_takes_an_hf_config_whose_heads_are_not_hidden_over_heads(tmp_path: Path) -> None:
    """Qwen3-0.6B's config.json: 16 heads of 128 at hidden 1024 (0.6B with its tied embedding; 0.44B without
    it, as its model card counts)."""
    qwen3 = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "num_hidden_layers": 28, "intermediate_size": 3072, "vocab_size": 151936,
             "max_position_embeddings": 40960, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(qwen3))
    shape = read_hf_shape(tmp_path)
    assert shape.attention_width == 2048 and shape.n_params() - 151936 * 1024 == pytest.approx(0.44e9, rel=0.01)
    lines = _plan(f"--hf-config {tmp_path} --gpus 8 --gpu h100-80gb --global-batch 8 --top 1")
    assert lines[0].startswith(f"{shape.n_params() / 1e6:.1f}M params")
    flags = _plan("--layers 28 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 128 --ffn 3072 --vocab 151936 "
                  "--seq 4096 --mlp swiglu --tied --gpus 8 --gpu h100-80gb --global-batch 8 --top 1")
    assert flags[0].startswith(f"{dataclasses.replace(shape, qk_norm=False).n_params() / 1e6:.1f}M params")
