"""GPT-OSS (OpenAI, 2025) as options of trainmesh's Llama: attention biases and sinks, the window on even
layers only, YaRN rope, biased experts with a clamped SwiGLU. Here: presets, planner shape, tp plan and
the ``GptOssForCausalLM`` translation (fused, interleaved ``gate_up_proj``; docs/models.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from trainmesh.models import llama
from trainmesh.models.llama import LlamaConfig
from trainmesh.models.moe import GPT_OSS_ALPHA, MoEConfig
from trainmesh.models.rope import RopeScaling
from trainmesh.models.spec import HFIncompatible, HFMapping


def _config(n_layers: int, d: int, heads: int, kv: int, head_dim: int, vocab: int, seq: int, window: int,
            experts: MoEConfig, rope: RopeScaling, theta: float = 150000.0) -> LlamaConfig:
    return LlamaConfig(n_layers, d, heads, kv, experts.d_ff_expert, vocab, seq, rope_theta=theta, head_dim=head_dim,
                       moe=experts, qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=window,
                       alternate_window=True, rope_scaling=rope)


PRESETS: dict[str, LlamaConfig] = {
    # Four layers (sliding, full, sliding, full) so pp2 stages hold one of each; four experts of hidden 48, top-2.
    "gpt-oss-tiny": _config(4, 64, 4, 2, 16, 256, 32, 8, MoEConfig(4, 2, 48, biases=True, swiglu_limit=7.0),
                            RopeScaling("yarn", 4.0, 8), theta=10000.0),
}

# openai/gpt-oss-20b's and gpt-oss-120b's config.json: 24 and 36 layers of 2880, 64 query and 8 KV heads of 64, 32
# and 128 experts of 2880 (top 4), 128-token windows on alternate layers, YaRN x32 over 4096; planned at 4096 tokens.
PLANNER_PRESETS: dict[str, LlamaConfig] = {
    f"gpt-oss-{size}": _config(layers, 2880, 64, 8, 64, 201088, 4096, 128,
                               MoEConfig(experts, 4, 2880, biases=True, swiglu_limit=7.0),
                               RopeScaling("yarn", 32.0, 4096, truncate=False))
    for size, layers, experts in (("20b", 24, 32), ("120b", 36, 128))
}

TP_PLAN: dict[str, str] = {**llama.TP_PLAN, "blocks.*.attn.core.sinks": "heads"}
"""Llama's plan, each rank keeping its query heads' sinks."""

LAYER_TYPES = ("sliding_attention", "full_attention")


def from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``GptOssForCausalLM`` one; layer types other than alternating from a sliding first layer
    (or all full), no biases, or another ``swiglu_alpha`` are refused."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    types = list(hf.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(n)])
    if types not in ([LAYER_TYPES[i % 2] for i in range(n)], [LAYER_TYPES[1]] * n) or \
            not hf.get("attention_bias", True) or hf.get("swiglu_alpha", GPT_OSS_ALPHA) != GPT_OSS_ALPHA:
        raise HFIncompatible(f"layer_types {types}, attention_bias {hf.get('attention_bias')} or swiglu_alpha "
                             f"{hf.get('swiglu_alpha')} differ from GPT-OSS's (sliding layers first and alternating, "
                             f"biases, {GPT_OSS_ALPHA}); trainmesh cannot import this checkpoint")
    moe = MoEConfig(hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"], biases=True,
                    swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                    aux_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    base = llama.from_hf_config({**hf, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"})
    sliding = window is not None and types[0] == LAYER_TYPES[0]
    return dataclasses.replace(base, moe=moe, qkv_bias=True, o_bias=True, attention_sinks=True,
                               sliding_window=window if sliding else None, alternate_window=sliding)


def to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """The ``GptOssConfig`` attributes of ours; refused where GPT-OSS computes otherwise."""
    m = cfg.moe
    here = (m.biases, m.n_shared_experts, m.n_dense_layers, m.score, m.normalize_top_k, m.group_limited,
            cfg.attention_sinks, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.alternate_window or not cfg.sliding_window)
    if here != (True, 0, 0, "softmax", True, False, True, True, True, False, True):
        raise HFIncompatible("GptOssForCausalLM has biased experts and router, softmax top-k routing, no shared or "
                             "dense layers, sinks, q/k/v/o biases, no q/k norms and windows on alternate layers; "
                             "this model differs, so it cannot be written as one")
    plain = dataclasses.replace(cfg, moe=None, qkv_bias=False, o_bias=False, attention_sinks=False, sliding_window=None)
    attributes = {k: v for k, v in llama.to_hf_config(plain).items() if k not in ("mlp_bias", "hidden_act")}
    types = [LAYER_TYPES[i % 2] if cfg.sliding_window else LAYER_TYPES[1] for i in range(cfg.n_layers)]
    return {**attributes, "attention_bias": True, "intermediate_size": m.d_ff_expert, "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_coef, "swiglu_limit": m.swiglu_limit,
            "swiglu_alpha": GPT_OSS_ALPHA, "sliding_window": cfg.sliding_window, "layer_types": types}


def _names(i: int) -> dict[str, str]:
    """Our name -> HF's for layer ``i``'s one-to-one tensors outside the Llama layout."""
    ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
    return {ours + "attn.o.bias": theirs + "self_attn.o_proj.bias", ours + "attn.core.sinks.weight":
            theirs + "self_attn.sinks", ours + "mlp.router.gate.weight": theirs + "mlp.router.weight",
            ours + "mlp.router.gate.bias": theirs + "mlp.router.bias", ours + "mlp.experts.w2":
            theirs + "mlp.experts.down_proj", ours + "mlp.experts.b2": theirs + "mlp.experts.down_proj_bias"}


def layer_from_hf(cfg: LlamaConfig, hf: llama.Tensors, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s o bias, sinks, router and experts, gate and up taken from alternate ``gate_up`` columns."""
    experts, ours = f"model.layers.{i}.mlp.experts.", f"blocks.{i}.mlp.experts."
    gate_up, bias = hf[experts + "gate_up_proj"], hf[experts + "gate_up_proj_bias"]
    return {**{name: hf[theirs] for name, theirs in _names(i).items()},
            ours + "w1": gate_up[..., ::2].contiguous(), ours + "w3": gate_up[..., 1::2].contiguous(),
            ours + "b1": bias[..., ::2].contiguous(), ours + "b3": bias[..., 1::2].contiguous()}


def layer_to_hf(cfg: LlamaConfig, ours: llama.Tensors, i: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`layer_from_hf`: gate and up interleaved column by column."""
    experts, mine = f"model.layers.{i}.mlp.experts.", f"blocks.{i}.mlp.experts."
    llama.refuse_routing_bias(ours, i, "GptOssForCausalLM")
    return {**{theirs: ours[name] for name, theirs in _names(i).items()},
            experts + "gate_up_proj": torch.stack([ours[mine + "w1"], ours[mine + "w3"]], -1).flatten(-2),
            experts + "gate_up_proj_bias": torch.stack([ours[mine + "b1"], ours[mine + "b3"]], -1).flatten(-2)}


HF_MAPPING = HFMapping("GptOssForCausalLM", "gpt_oss", from_hf_config, to_hf_config,
                       lambda cfg, hf: llama._from_hf(cfg, hf, layer_from_hf),
                       lambda cfg, ours: llama._to_hf(cfg, ours, layer_to_hf), buffers=llama.ROTARY_BUFFERS)
