"""DeepSeek-V3 (DeepSeek-AI, 2024) at tiny sizes as an option of trainmesh's Llama: latent attention, sigmoid routing
with the aux-loss-free bias (§2.1.2) and group limits, shared experts, dense first layers, and the
``DeepseekV3ForCausalLM`` translation. tp splits heads and keeps the compressions whole (``per_head``); cp is
Llama's plan, the shared rotary key expanded to every head before the core."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from trainmesh.models import llama
from trainmesh.models.llama import LlamaConfig
from trainmesh.models.moe import MoEConfig
from trainmesh.models.qwen import expert_names
from trainmesh.models.rope import rope_from_hf, rope_to_hf
from trainmesh.models.spec import HFIncompatible, HFMapping

PRESETS: dict[str, LlamaConfig] = {
    # Two layers: the first dense, the second eight sigmoid-routed experts (two per token, from the best two of
    # four groups of two, as DeepSeek-V3's four of eight groups) and one shared.
    "deepseek-v3-tiny": LlamaConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=176, vocab_size=256,
                                    seq_len=32, rope_theta=10000.0, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=16,
                                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                    moe=MoEConfig(n_experts=8, top_k=2, d_ff_expert=32, n_shared_experts=1,
                                                  n_dense_layers=1, score="sigmoid", route_scale=2.5,
                                                  aux_coef=0.0, bias_rate=0.001, expert_groups=4,
                                                  groups_per_token=2)),
}

TP_PLAN: dict[str, str] = {
    "embed": "vocab",
    "blocks.*.attn_norm": "sequence",
    "blocks.*.mlp_norm": "sequence",
    "blocks.*.attn": "prepare_input",
    "blocks.*.attn.q_a": "per_head",
    "blocks.*.attn.q_norm": "per_head",
    "blocks.*.attn.q_b": "colwise_local",
    "blocks.*.attn.kv_a": "per_head",
    "blocks.*.attn.kv_norm": "per_head",
    "blocks.*.attn.kv_b": "colwise_local",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.gate_up": "colwise_pair",
    "blocks.*.mlp.down": "rowwise",
    "ln_f": "sequence",
    "head": "vocab",
}
"""Heads split (see the module docstring); the dense first layers' MLPs as Llama's, the MoE layers whole on
every tp rank (``expert_parallel.moe_tp_plan``)."""


def from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``DeepseekV3ForCausalLM`` one; anything it computes that ours does not is refused."""
    differs = {"attention_bias": (bool(hf.get("attention_bias")), False),
               "norm_topk_prob": (bool(hf.get("norm_topk_prob")), True),
               "hidden_act": (hf.get("hidden_act"), "silu")}
    for what, (there, ours) in differs.items():
        if there != ours:
            raise HFIncompatible(f"{what} is {there!r}; trainmesh's DeepSeek-V3 has {ours!r}, so this checkpoint "
                                 f"cannot be imported")
    moe = MoEConfig(n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                    d_ff_expert=hf["moe_intermediate_size"], n_shared_experts=hf.get("n_shared_experts") or 0,
                    n_dense_layers=hf.get("first_k_dense_replace", 0), score="sigmoid",
                    route_scale=float(hf.get("routed_scaling_factor", 1.0)), aux_coef=0.0,
                    expert_groups=hf.get("n_group") or 1, groups_per_token=hf.get("topk_group") or 1)
    theta, scaling = rope_from_hf(hf)
    heads = hf["num_attention_heads"]
    return LlamaConfig(n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=heads, n_kv_heads=heads,
                       d_ff=hf["intermediate_size"], vocab_size=hf["vocab_size"], seq_len=hf["max_position_embeddings"],
                       rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf["rms_norm_eps"]),
                       tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       moe=moe, q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                       qk_rope_head_dim=hf["qk_rope_head_dim"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                       v_head_dim=hf["v_head_dim"])


def to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """The ``DeepseekV3Config`` attributes of ours (rotary weights written interleaved, as DeepSeek's are)."""
    llama.refuse_options(dataclasses.replace(cfg, kv_lora_rank=0), "DeepseekV3ForCausalLM")
    m = cfg.moe
    if not cfg.kv_lora_rank or m is None or m.score != "sigmoid":
        raise HFIncompatible("DeepseekV3ForCausalLM has latent attention and sigmoid-routed experts, which this "
                             "model has not; export it as its own family")
    return {"hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "q_lora_rank": cfg.q_lora_rank or None,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim, "rope_interleave": True,
            "n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.d_ff_expert,
            "n_shared_experts": m.n_shared_experts, "first_k_dense_replace": m.n_dense_layers,
            "n_group": m.expert_groups, "topk_group": m.groups_per_token, "norm_topk_prob": True,
            "routed_scaling_factor": m.route_scale, "hidden_act": "silu", "attention_bias": False,
            "bos_token_id": None, "eos_token_id": None, **rope_to_hf(cfg.rope_scaling)}


def _deinterleave(rows: torch.Tensor, width: int, rope: int, inverse: bool = False) -> torch.Tensor:
    """Rows in blocks of ``width`` whose last ``rope`` are rotary features: DeepSeek's interleaved pairs
    ``(x0, x1), (x2, x3), ...`` as rotate-half's ``x0, x2, ..., x1, x3, ...`` (or back, ``inverse``)."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    order = torch.argsort(order) if inverse else order
    blocks = rows.reshape(-1, width, *rows.shape[1:])
    return torch.cat([blocks[:, : width - rope], blocks[:, width - rope:][:, order]], dim=1).reshape(rows.shape)


_ATTENTION = {"q_a": "q_a_proj", "q_norm": "q_a_layernorm", "q_b": "q_b_proj", "q": "q_proj",
              "kv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_b": "kv_b_proj", "o": "o_proj"}
_SHARED = {"gate_up": None, "down": "down_proj"}


def _attention_names(cfg: LlamaConfig, i: int) -> dict[str, str]:
    parts = [p for p in _ATTENTION if (p in ("q_a", "q_norm", "q_b")) == bool(cfg.q_lora_rank) or p not in
             ("q_a", "q_norm", "q_b", "q")]
    return {f"blocks.{i}.attn.{p}.weight": f"model.layers.{i}.self_attn.{_ATTENTION[p]}.weight" for p in parts}


def _rotary_rows(cfg: LlamaConfig) -> dict[str, int]:
    """Our attention weights whose rows hold rotary features, with their block width."""
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return {"q_b" if cfg.q_lora_rank else "q": qk, "kv_a": cfg.kv_lora_rank + cfg.qk_rope_head_dim}


def _mlp_from_hf(cfg: LlamaConfig, hf: llama.Tensors, i: int) -> dict[str, torch.Tensor]:
    if i < cfg.moe.n_dense_layers:
        return llama.dense_mlp_from_hf(cfg, hf, i)
    ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
    out = {**llama.stack_experts(cfg, hf, i, expert_names, theirs + "gate.weight"),
           ours + "router.expert_bias": hf[theirs + "gate.e_score_correction_bias"]}
    if cfg.moe.n_shared_experts:
        shared = theirs + "shared_experts."
        out[ours + "shared.gate_up.weight"] = torch.cat([hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]])
        out[ours + "shared.down.weight"] = hf[shared + "down_proj.weight"]
    return out


def _mlp_to_hf(cfg: LlamaConfig, ours: llama.Tensors, i: int) -> dict[str, torch.Tensor]:
    if i < cfg.moe.n_dense_layers:
        return llama.dense_mlp_to_hf(cfg, ours, i)
    mine, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
    out = llama.unstack_experts(cfg, ours, i, expert_names, theirs + "gate.weight", None)
    bias = ours.get(mine + "router.expert_bias")
    out[theirs + "gate.e_score_correction_bias"] = bias if bias is not None else torch.zeros(cfg.moe.n_experts)
    if cfg.moe.n_shared_experts:
        gate, up = ours[mine + "shared.gate_up.weight"].chunk(2)
        out.update({theirs + "shared_experts.gate_proj.weight": gate, theirs + "shared_experts.up_proj.weight": up,
                    theirs + "shared_experts.down_proj.weight": ours[mine + "shared.down.weight"]})
    return out


def from_hf(cfg: LlamaConfig, hf: llama.Tensors) -> dict[str, torch.Tensor]:
    """Our state dict (and routing biases) from a ``DeepseekV3ForCausalLM`` one."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "ln_f.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = hf["lm_head.weight"]
    rotary = _rotary_rows(cfg)
    for i in range(cfg.n_layers):
        layer = f"model.layers.{i}."
        out[f"blocks.{i}.attn_norm.weight"] = hf[layer + "input_layernorm.weight"]
        out[f"blocks.{i}.mlp_norm.weight"] = hf[layer + "post_attention_layernorm.weight"]
        for name, theirs in _attention_names(cfg, i).items():
            part = name.split(".")[3]
            tensor = hf[theirs]
            out[name] = tensor if part not in rotary or tensor.is_meta else _deinterleave(tensor, rotary[part],
                                                                                           cfg.qk_rope_head_dim)
        out.update(_mlp_from_hf(cfg, hf, i))
    return out


def to_hf(cfg: LlamaConfig, ours: llama.Tensors) -> dict[str, torch.Tensor]:
    """The ``DeepseekV3ForCausalLM`` state dict of ours (the inverse of :func:`from_hf`)."""
    out = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["ln_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ours["head.weight"]
    rotary = _rotary_rows(cfg)
    for i in range(cfg.n_layers):
        layer = f"model.layers.{i}."
        out[layer + "input_layernorm.weight"] = ours[f"blocks.{i}.attn_norm.weight"]
        out[layer + "post_attention_layernorm.weight"] = ours[f"blocks.{i}.mlp_norm.weight"]
        for name, theirs in _attention_names(cfg, i).items():
            part = name.split(".")[3]
            out[theirs] = (ours[name] if part not in rotary else
                           _deinterleave(ours[name], rotary[part], cfg.qk_rope_head_dim, inverse=True))
        out.update(_mlp_to_hf(cfg, ours, i))
    return {name: t.contiguous() for name, t in out.items()}


HF_MAPPING = HFMapping("DeepseekV3ForCausalLM", "deepseek_v3", from_hf_config, to_hf_config, from_hf, to_hf,
                       buffers=llama.ROTARY_BUFFERS)
