"""Qwen2/Qwen2.5 (Yang et al., 2024) and Qwen3 (Yang et al., 2025) as options of trainmesh's Llama
(:mod:`trainmesh.models.llama`): the same module, the same tensor layout, the same Hugging Face tensor names.

* Qwen2 puts biases on the q, k and v projections and nowhere else (``LlamaConfig.qkv_bias``); its small
  sizes tie the output head to the embedding.
* Qwen3 drops those biases and normalises each query and key head by an RMSNorm over its ``head_dim``
  before the rotation (``LlamaConfig.qk_norm``).

What is left here is data: the tiny presets the tests train, the published shapes the planner plans, and
the translation of transformers' ``Qwen2Config``/``Qwen3Config`` both ways. Their sliding-window layers
(``use_sliding_window``, off in every released Qwen2/Qwen3 checkpoint) are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainmesh.models import llama
from trainmesh.models.llama import LlamaConfig
from trainmesh.models.spec import HFIncompatible, HFMapping

QWEN2_PRESETS: dict[str, LlamaConfig] = {
    "qwen2-tiny": LlamaConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, seq_len=64,
                              rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
}
QWEN3_PRESETS: dict[str, LlamaConfig] = {
    "qwen3-tiny": LlamaConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, seq_len=64,
                              rope_theta=1e6, norm_eps=1e-6, qk_norm=True),
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
