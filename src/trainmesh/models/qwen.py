"""Qwen2/Qwen2.5 (Yang et al., 2024) and Qwen3 (Yang et al., 2025) as options of trainmesh's Llama: the same
module, tensor layout and HF names. Qwen2 adds q/k/v biases (``qkv_bias``), Qwen3 per-head q/k RMSNorm
(``qk_norm``) and 128-wide heads (``head_dim``), Qwen3-MoE SwiGLU experts (``moe``). Here: presets,
planner shapes and the config translation; sliding-window layers are refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from trainmesh.models import llama
from trainmesh.models.llama import LlamaConfig
from trainmesh.models.moe import MoEConfig
from trainmesh.models.spec import HFIncompatible, HFMapping

QWEN2_PRESETS: dict[str, LlamaConfig] = {
    "qwen2-tiny": LlamaConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, seq_len=64,
                              rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
}
QWEN3_PRESETS: dict[str, LlamaConfig] = {
    # Heads twice d_model / n_heads wide, as Qwen3-0.6B's 128 at d 1024 with 16 heads.
    "qwen3-tiny": LlamaConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, seq_len=64,
                              rope_theta=1e6, norm_eps=1e-6, qk_norm=True, head_dim=32),
}

# Their Hugging Face configs: Qwen2.5-7B (28 layers, 3584 wide, 4 KV heads, untied) and Qwen3-8B (36 layers,
# head_dim 128 = 4096 / 32), planned at 4096 tokens.
QWEN2_PLANNER_PRESETS: dict[str, LlamaConfig] = {
    "qwen2.5-7b": LlamaConfig(28, 3584, 28, 4, 18944, 152064, 4096, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
}
QWEN3_PLANNER_PRESETS: dict[str, LlamaConfig] = {
    "qwen3-8b": LlamaConfig(36, 4096, 32, 8, 12288, 151936, 4096, rope_theta=1e6, norm_eps=1e-6, qk_norm=True),
}

QWEN3_TP_PLAN: dict[str, str] = {**llama.TP_PLAN, "blocks.*.attn.[qk]_norm": "per_head"}
"""Llama's plan, and the q/k norms replicated on every tp rank, which applies them to its own heads."""


def _llama_config(hf: Mapping[str, Any], architecture: str) -> LlamaConfig:
    if hf.get("use_sliding_window"):
        raise HFIncompatible(f"use_sliding_window is true; trainmesh's {architecture} attends over the whole "
                             f"sequence, so this checkpoint cannot be imported")
    return llama.from_hf_config({**hf, "attention_bias": False})


def qwen2_from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``Qwen2ForCausalLM`` one: a Llama with q/k/v biases."""
    return dataclasses.replace(_llama_config(hf, "Qwen2"), qkv_bias=True)


def qwen3_from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``Qwen3ForCausalLM`` one: a Llama with q/k norms (and, like Qwen3, no biases)."""
    if hf.get("attention_bias"):
        raise HFIncompatible("attention_bias is true; trainmesh's Qwen3 has no q/k/v biases, so this checkpoint "
                             "cannot be imported")
    return dataclasses.replace(_llama_config(hf, "Qwen3"), qk_norm=True)


def _attributes(cfg: LlamaConfig, architecture: str, option: str) -> dict[str, Any]:
    llama.refuse_options(dataclasses.replace(cfg, **{option: False}), architecture)
    if not getattr(cfg, option):
        raise HFIncompatible(f"this model has no {llama.OPTIONS[option]}, which every {architecture} has; "
                             f"export it as a Llama instead")
    attributes = {k: v for k, v in llama.to_hf_config(dataclasses.replace(cfg, **{option: False})).items()
                  if k not in ("attention_bias", "mlp_bias")}
    return {**attributes, "use_sliding_window": False, "sliding_window": None}


def qwen2_to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    return _attributes(cfg, "Qwen2ForCausalLM", "qkv_bias")


def qwen3_to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    return {**_attributes(cfg, "Qwen3ForCausalLM", "qk_norm"), "attention_bias": False}


QWEN2_MAPPING = HFMapping("Qwen2ForCausalLM", "qwen2", qwen2_from_hf_config, qwen2_to_hf_config, llama.from_hf,
                          llama.to_hf, buffers=llama.ROTARY_BUFFERS)
QWEN3_MAPPING = HFMapping("Qwen3ForCausalLM", "qwen3", qwen3_from_hf_config, qwen3_to_hf_config, llama.from_hf,
                          llama.to_hf, buffers=llama.ROTARY_BUFFERS)


# --- Qwen3-MoE: Qwen3 attention, softmax-routed SwiGLU experts ----------------------------------------

QWEN3_MOE_PRESETS: dict[str, LlamaConfig] = {
    # Eight experts of hidden 48, two per token, on a two-layer qwen3-tiny body.
    "qwen3-moe-tiny": LlamaConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256,
                                  seq_len=32, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                                  moe=MoEConfig(n_experts=8, top_k=2, d_ff_expert=48, normalize_top_k=True,
                                                aux_coef=0.001)),
}


def qwen3_moe_from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``Qwen3MoeForCausalLM`` one: Qwen3 attention, softmax-routed SwiGLU experts past the leading
    ``mlp_only_layers``; dense layers anywhere but first (``decoder_sparse_step`` above 1) are refused."""
    dense = list(hf.get("mlp_only_layers") or [])
    if hf.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
        raise HFIncompatible(f"decoder_sparse_step {hf.get('decoder_sparse_step')} and mlp_only_layers {dense} put "
                             f"dense layers between expert layers; trainmesh's MoE has them only first")
    moe = MoEConfig(n_experts=hf.get("num_local_experts") or hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    d_ff_expert=hf["moe_intermediate_size"], n_dense_layers=len(dense),
                    normalize_top_k=bool(hf.get("norm_topk_prob")),
                    aux_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    return dataclasses.replace(qwen3_from_hf_config(hf), moe=moe)


def qwen3_moe_to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """The ``Qwen3MoeConfig`` attributes of ours; refused where Qwen3-MoE has no place for what ours computes
    (shared experts, sigmoid scores, group-limited routing)."""
    m = cfg.moe
    differs = {"n_shared_experts": (m.n_shared_experts, 0), "score": (m.score, "softmax"),
               "group_limited": (m.group_limited, False)}
    for what, (here, theirs) in differs.items():
        if here != theirs:
            raise HFIncompatible(f"{what} is {here!r}; Qwen3MoeForCausalLM has {theirs!r}, so this model cannot be "
                                 f"written as one")
    return {**qwen3_to_hf_config(dataclasses.replace(cfg, moe=None)), "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.d_ff_expert,
            "norm_topk_prob": m.normalize_top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(m.n_dense_layers)), "router_aux_loss_coef": m.aux_coef}


def expert_names(i: int, e: int) -> tuple[str, str, str]:
    """Expert ``e`` of layer ``i`` as Qwen3-MoE and DeepSeek-V3 write it: gate, up and down projections."""
    prefix = f"model.layers.{i}.mlp.experts.{e}."
    return prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "down_proj.weight"


def moe_from_hf(cfg: LlamaConfig, hf: llama.Tensors, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s MLP: dense before ``n_dense_layers``, else the router ``mlp.gate`` and the experts."""
    if i < cfg.moe.n_dense_layers:
        return llama.dense_mlp_from_hf(cfg, hf, i)
    return llama.stack_experts(cfg, hf, i, expert_names, f"model.layers.{i}.mlp.gate.weight")


def moe_to_hf(cfg: LlamaConfig, ours: llama.Tensors, i: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`moe_from_hf`."""
    if i < cfg.moe.n_dense_layers:
        return llama.dense_mlp_to_hf(cfg, ours, i)
    return llama.unstack_experts(cfg, ours, i, expert_names, f"model.layers.{i}.mlp.gate.weight", "Qwen3MoeForCausalLM")


QWEN3_MOE_MAPPING = HFMapping("Qwen3MoeForCausalLM", "qwen3_moe", qwen3_moe_from_hf_config, qwen3_moe_to_hf_config,
                              lambda cfg, hf: llama._from_hf(cfg, hf, moe_from_hf),
                              lambda cfg, ours: llama._to_hf(cfg, ours, moe_to_hf), buffers=llama.ROTARY_BUFFERS)
