"""Hugging Face transformers' ``LlamaForCausalLM`` as a model family: a spec, not code in a parallel form.

The model is used as transformers builds it (``model.embed_tokens``, the ``model.layers`` list of
``LlamaDecoderLayer``, ``model.norm``, ``lm_head``; parameter names unchanged, so its checkpoints still fit).
What its own ``forward`` does around the layers is done here so that any pipeline stage can run any
subset of them: the stage layout names the parts for :class:`~trainmesh.models.spec.Staged`, and
:func:`add_rotary` gives each attention module its rotary ``(cos, sin)`` from the sequence it sees,
computed by the model's own ``rotary_emb``. Attention runs causal with no mask (``sdpa``'s ``is_causal``),
which is what the model does for unpadded training batches.

``transformers`` is never imported here: the family is recognised by class name and module, so
``import trainmesh`` works without it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from trainmesh.models.spec import ModelShape, StageLayout

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

RECOMPUTE = {"full": ("LlamaDecoderLayer",), "selective": ("LlamaAttention",)}
"""``full``: each decoder layer; ``selective``: each attention module (projections and core: Hugging Face
computes the core in a function, not a module of its own)."""


def accepts(model: nn.Module) -> bool:
    cls = type(model)
    return cls.__name__ == "LlamaForCausalLM" and cls.__module__.startswith("transformers.")


def layout(model: nn.Module) -> StageLayout:
    return StageLayout(blocks="model.layers", pre="model.embed_tokens", post=("model.norm", "lm_head"),
                       hidden_size=model.config.hidden_size)


def config_of(model: nn.Module) -> Any:
    return model.config


def shape(config: Any) -> ModelShape:
    """The planner's and the validator's view of a ``transformers.LlamaConfig``."""
    return ModelShape(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                      config.intermediate_size, config.vocab_size, config.max_position_embeddings, gated_mlp=True,
                      bias=bool(config.attention_bias or config.mlp_bias), learned_positions=False,
                      n_kv_heads=config.num_key_value_heads, tied_embeddings=bool(config.tie_word_embeddings))


def _with_rotary(rotary: nn.Module, _attn: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Pre-hook of an attention module: the rotary ``(cos, sin)`` of positions ``0..seq-1`` of its input."""
    if kwargs.get("position_embeddings") is not None:
        return None
    x = args[0] if args else kwargs["hidden_states"]
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    return args, {**kwargs, "position_embeddings": rotary(x, positions)}


def add_rotary(model: nn.Module) -> None:
    """Give every decoder layer's attention its rotary embedding, from the input it sees (the whole
    sequence, once a tensor-parallel plan's ``prepare_input`` has gathered it under sequence parallelism).
    Refuses an attention implementation that would need a mask to be causal."""
    config = model.model.config
    if config._attn_implementation not in CAUSAL_IMPLEMENTATIONS:
        raise ValueError(f"this Llama uses attn_implementation={config._attn_implementation!r}, which needs an "
                         f"explicit causal mask; build or load it with attn_implementation='sdpa'")
    hook = functools.partial(_with_rotary, model.model.rotary_emb)
    for layer in model.blocks.values():
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
