"""Gemma 3 (Gemma Team, 2025), text-only, as options of trainmesh's Llama: q/k norms, local sliding-window layers
with their own rope base between global ones (``global_every``), ``1 + w`` RMSNorms before and after attention
and MLP, embeddings times sqrt(d_model), GeGLU, a tied head, the softmax scaled by ``query_pre_attn_scalar``.
Windows stay in the attention core, so they hold under tp, cp and KV-cache decoding as Mistral's do. Logit
soft-capping (None in Gemma 3's configs) and bidirectional attention are refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainmesh.models import llama, qwen
from trainmesh.models.llama import LlamaConfig
from trainmesh.models.rope import rope_from_hf, rope_to_hf
from trainmesh.models.spec import HFIncompatible, HFMapping

GEMMA = dict(qk_norm=True, tie_embeddings=True, norm_offset=True, sandwich_norm=True, embed_scale=True,
             mlp_act="gelu_tanh")

PRESETS: dict[str, LlamaConfig] = {
    # Local and global layers alternating, a window of 8 in 32-token sequences; heads twice d / heads wide and a
    # softmax scale of 1/sqrt(48), not 1/sqrt(32), as Gemma 3 27B's differs from its head size.
    "gemma3-tiny": LlamaConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256, seq_len=32,
                               rope_theta=1e6, norm_eps=1e-6, sliding_window=8, head_dim=32, global_every=2,
                               local_rope_theta=1e4, query_pre_attn_scalar=48, **GEMMA),
}

# google/gemma-3-1b-pt's config: 26 layers of 1152, 4 heads of 256 over 1 KV head, 512-token windows with
# every 6th layer global, 262,144-token vocabulary; planned at 8192 tokens.
PLANNER_PRESETS: dict[str, LlamaConfig] = {
    "gemma3-1b": LlamaConfig(26, 1152, 4, 1, 6912, 262144, 8192, rope_theta=1e6, norm_eps=1e-6, sliding_window=512,
                             head_dim=256, global_every=6, local_rope_theta=1e4, query_pre_attn_scalar=256, **GEMMA),
}

TP_PLAN: dict[str, str] = {**qwen.QWEN3_TP_PLAN, "blocks.*.*_post_norm": "sequence"}
"""Qwen3's plan, and the norms after attention and MLP replicated as the ones before them."""

REFUSED = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "final_logit_softcapping": None,
           "attn_logit_softcapping": None, "use_bidirectional_attention": False}


def layer_types(cfg: LlamaConfig) -> list[str]:
    """HF's ``layer_types`` of ``cfg``."""
    return ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layers)]


def from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``Gemma3ForCausalLM`` one; layer types other than every n-th layer global are refused."""
    for what, ours in REFUSED.items():
        if (hf.get(what) or ours) != ours:
            raise HFIncompatible(f"{what} is {hf.get(what)!r}; trainmesh's Gemma 3 has {ours!r}, so this "
                                 f"checkpoint cannot be imported")
    if not hf.get("tie_word_embeddings", True):  # GEMMA below ties it, so check what the config says first
        raise HFIncompatible("tie_word_embeddings is false; trainmesh's Gemma 3 ties its head to the embedding, as "
                             "every published Gemma 3 does, so an untied one cannot be imported")
    types, rope = list(hf["layer_types"]), hf.get("rope_parameters") or {}
    theta, scaling = rope_from_hf({**hf, "rope_parameters": rope.get("full_attention")})
    local_theta, local_scaling = rope_from_hf({**hf, "rope_parameters": rope.get("sliding_attention")})
    every = types.index("full_attention") + 1 if "full_attention" in types else 0
    cfg = dataclasses.replace(llama.from_hf_config({**hf, "hidden_act": "silu", "rope_parameters": None,
                                                    "rope_theta": theta}),
                              rope_scaling=scaling, sliding_window=hf.get("sliding_window") if every != 1 else None,
                              global_every=every if every > 1 else 0, local_rope_theta=local_theta,
                              query_pre_attn_scalar=hf.get("query_pre_attn_scalar"), **GEMMA)
    if layer_types(cfg) != types or local_scaling is not None:
        raise HFIncompatible(f"layer_types {types} or a scaled local rope: trainmesh's Gemma 3 has every n-th layer "
                             f"global and unscaled local ropes, so this cannot be imported")
    return cfg


def to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """The ``Gemma3TextConfig`` attributes of ours; a model without all of Gemma's options is refused."""
    plain = dataclasses.replace(cfg, qk_norm=False, sliding_window=None, rope_scaling=None)
    llama.refuse_options(plain, "Gemma3ForCausalLM")
    if any(getattr(cfg, k) != v for k, v in GEMMA.items()):
        raise HFIncompatible(f"Gemma3ForCausalLM has {GEMMA}; this model differs, so it cannot be written as one")
    attributes = {k: v for k, v in llama.to_hf_config(plain).items() if k not in ("hidden_act", "mlp_bias")}
    scaling = rope_to_hf(cfg.rope_scaling).get("rope_scaling", {})
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **scaling}
    local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
    return {**attributes, **REFUSED, "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_size,
            "sliding_window": cfg.sliding_window, "layer_types": layer_types(cfg),
            "rope_parameters": {"full_attention": full, "sliding_attention": local}}


HF_MAPPING = HFMapping("Gemma3ForCausalLM", "gemma3_text", from_hf_config, to_hf_config, llama.from_hf, llama.to_hf,
                       buffers=llama.ROTARY_BUFFERS)
