"""transformers' ``LlamaForCausalLM`` and its variants (Qwen2, Qwen3, Mistral) as model families: specs, not code in a
parallel form. The model is used as built (names unchanged); what its ``forward`` does around the layers is done here
so any stage runs any subset. transformers is never imported: the family is recognised by class name and module."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from trainmesh.models.documents import current
from trainmesh.models.spec import ModelShape, StageLayout, explicit_head_dim

CAUSAL_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab",
    "model.layers.*.*_layernorm": "sequence",
    "model.layers.*.self_attn": "prepare_input",
    "model.layers.*.self_attn.[qkv]_proj": "colwise_local",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp": "prepare_input",
    "model.layers.*.mlp.[gu]*_proj": "colwise_local",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "sequence",
    "lm_head": "vocab",
}
"""Megatron-LM's split under Hugging Face's Llama names: q/k/v and gate/up column-parallel (each rank whole
query and KV heads: tp must divide the KV heads), o and down row-parallel, embedding and head by vocabulary,
the RMSNorms replicated in the sequence-parallel region. Attention and MLP make their input whole once
(``prepare_input``) for their separate column-parallel projections."""

ARCHITECTURES = {"LlamaForCausalLM": "Llama", "Qwen2ForCausalLM": "Qwen2", "Qwen3ForCausalLM": "Qwen3",
                 "MistralForCausalLM": "Mistral"}
"""The transformers classes of this layout, with their class-name prefix."""


def plan(architecture: str) -> dict[str, str]:
    """:data:`PLAN`, and for Qwen3 its per-head q/k norms replicated with their gradients summed over tp."""
    return {**PLAN, "model.layers.*.self_attn.[qk]_norm": "per_head"} if architecture == "Qwen3ForCausalLM" else PLAN


def recompute(architecture: str) -> dict[str, tuple[str, ...]]:
    """``full``: each decoder layer; ``selective``: each attention module (projections and core: Hugging Face
    computes the core in a function, not a module of its own)."""
    prefix = ARCHITECTURES[architecture]
    return {"full": (f"{prefix}DecoderLayer",), "selective": (f"{prefix}Attention",)}


def accepts_class(architecture: str):
    """Whether a model object is transformers' ``architecture``."""
    def accepts(model: nn.Module) -> bool:
        cls = type(model)
        return cls.__name__ == architecture and cls.__module__.startswith("transformers.")
    return accepts


def layout(model: nn.Module) -> StageLayout:
    return StageLayout(blocks="model.layers", pre="model.embed_tokens", post=("model.norm", "lm_head"),
                       hidden_size=model.config.hidden_size)


def config_of(model: nn.Module) -> Any:
    return model.config


def window_of(config: Any) -> int | None:
    """The sliding window a config's attention keeps (Mistral's; Qwen's only with ``use_sliding_window``)."""
    on = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    return getattr(config, "sliding_window", None) if on else None


def shape(config: Any) -> ModelShape:
    """The planner's and the validator's view of a ``transformers.LlamaConfig`` (or Qwen2, Qwen3, Mistral)."""
    qkv_bias = config.model_type == "qwen2"
    bias = bool(getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False))
    return ModelShape(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                      config.intermediate_size, config.vocab_size, config.max_position_embeddings, gated_mlp=True,
                      bias=bias, learned_positions=False, n_kv_heads=config.num_key_value_heads,
                      tied_embeddings=bool(config.tie_word_embeddings), qkv_bias=qkv_bias and not bias,
                      qk_norm=config.model_type == "qwen3", sliding_window=window_of(config),
                      head_dim=explicit_head_dim(config.hidden_size, config.num_attention_heads,
                                                 getattr(config, "head_dim", None)))


def _with_rotary(rotary: nn.Module, window: int | None, implementation: str, _attn: nn.Module, args: tuple,
                 kwargs: dict) -> tuple[tuple, dict] | None:
    """Pre-hook of an attention module: the rotary ``(cos, sin)`` of positions ``0..seq-1`` of its input, and
    with a sliding ``window`` the boolean mask keeping it (without one, the attention is causal by itself); inside
    packed documents (:mod:`~trainmesh.models.documents`) each document's positions and a mask confined to it."""
    if kwargs.get("position_embeddings") is not None:
        return None
    x = args[0] if args else kwargs["hidden_states"]
    t = x.shape[1]
    packing = current()
    positions = torch.arange(t, device=x.device).unsqueeze(0) if packing is None else packing.positions.to(x.device)
    extra = {}
    if packing is not None or (window is not None and window < t):
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if window is not None:
            mask &= ~torch.ones_like(mask).tril(-window)
        extra["attention_mask"] = mask[None, None] if packing is None else _within_documents(mask, packing.documents,
                                                                                            implementation)
    return args, {**kwargs, "position_embeddings": rotary(x, positions), **extra}


def _within_documents(mask: torch.Tensor, documents: torch.Tensor, implementation: str) -> torch.Tensor:
    """``mask`` confined to each query's document, ``[batch, 1, t, t]``: SDPA takes it as it is, the flash
    implementations read a mask as padding, so they are refused for packed documents."""
    if implementation != "sdpa":
        raise ValueError(f"packed documents need a mask that attn_implementation={implementation!r} does not take; "
                         f"build or load the model with attn_implementation='sdpa'")
    documents = documents.to(mask.device)
    return (mask & (documents[:, :, None] == documents[:, None, :]))[:, None]


def add_rotary(model: nn.Module) -> None:
    """Give every decoder layer's attention its rotary embedding from the input it sees (whole, once ``prepare_input``
    gathered it under sp); refuses an attention implementation needing a mask to be causal."""
    config = model.model.config
    if config._attn_implementation not in CAUSAL_IMPLEMENTATIONS:
        raise ValueError(f"this Llama uses attn_implementation={config._attn_implementation!r}, which needs an "
                         f"explicit causal mask; build or load it with attn_implementation='sdpa'")
    hook = functools.partial(_with_rotary, model.model.rotary_emb, window_of(config), config._attn_implementation)
    for layer in model.blocks.values():
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
