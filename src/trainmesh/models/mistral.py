"""Mistral (Jiang et al., 2023, "Mistral 7B") as an option of trainmesh's Llama: each token attends to
itself and the ``sliding_window - 1`` tokens before it. The window belongs to the attention core, so it
holds under tp, cp (the ring masks and skips block pairs by global position) and KV-cache decoding."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainmesh.models import llama
from trainmesh.models.llama import LlamaConfig
from trainmesh.models.spec import HFMapping

PRESETS: dict[str, LlamaConfig] = {
    # A window of 8 in 32-token sequences, so most query-key pairs lie outside it.
    "mistral-tiny": LlamaConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256,
                                seq_len=32, rope_theta=10000.0, sliding_window=8),
}

# Mistral-7B-v0.1's config: GQA with 8 KV heads, a 4096-token window, 32K vocabulary.
PLANNER_PRESETS: dict[str, LlamaConfig] = {
    "mistral-7b": LlamaConfig(32, 4096, 32, 8, 14336, 32000, 8192, rope_theta=10000.0, sliding_window=4096),
}


def from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``MistralForCausalLM`` one: a Llama with its sliding window (if any)."""
    return dataclasses.replace(llama.from_hf_config(hf), sliding_window=hf.get("sliding_window") or None)


def to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    llama.refuse_options(dataclasses.replace(cfg, sliding_window=None), "MistralForCausalLM")
    attributes = llama.to_hf_config(dataclasses.replace(cfg, sliding_window=None))
    return {**{k: v for k, v in attributes.items() if k not in ("attention_bias", "mlp_bias")},
            "sliding_window": cfg.sliding_window}


HF_MAPPING = HFMapping("MistralForCausalLM", "mistral", from_hf_config, to_hf_config, llama.from_hf, llama.to_hf,
                       buffers=llama.ROTARY_BUFFERS)
