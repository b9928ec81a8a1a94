"""Named model shapes the planner knows: every preset of the model registry
(:func:`trainmesh.models.planner_shapes`, buildable families and their full-sized planning shapes) and,
in :data:`PLANNING_SHAPES`, published models of families trainmesh does not build."""

from __future__ import annotations

import dataclasses

from trainmesh.models import ModelShape, planner_shapes


def _gpt3_like(n_layers: int, d_model: int, n_heads: int) -> ModelShape:
    """A Megatron GPT shape [NAR, Table 1]: d_ff = 4h, vocab 51200 (GPT-2's padded), sequence 2048,
    dropout, attention that stores its score matrix."""
    return ModelShape(n_layers, d_model, n_heads, 4 * d_model, 51200, 2048, dropout=True, flash_attention=False)


def _llama_moe(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab: int, experts: int,
               top_k: int, d_ff_expert: int, shared: int = 0, dense_layers: int = 0) -> ModelShape:
    """A Llama-family mixture of experts (SwiGLU experts, RMSNorm, RoPE, untied head), planned at 4096 tokens per
    sequence, the pretraining length of DeepSeek-V3 and of Qwen3's first stage (``--seq`` changes it)."""
    return ModelShape(n_layers, d_model, n_heads, d_ff, vocab, 4096, gated_mlp=True, bias=False,
                      learned_positions=False, n_kv_heads=n_kv_heads, n_experts=experts, top_k=top_k,
                      n_shared_experts=shared, d_ff_expert=d_ff_expert, n_dense_layers=dense_layers)


PLANNING_SHAPES: dict[str, ModelShape] = {
    # Planning-only shapes of a family trainmesh does not build (Megatron's GPT, with dropout).
    "gpt3-175b": _gpt3_like(96, 12288, 96),
    "megatron-530b": _gpt3_like(105, 20480, 128),
    "megatron-1t": _gpt3_like(128, 25600, 160),
    # Mixtures of experts trainmesh does not build, from the published Hugging Face configs (Mixtral-8x7B is
    # a buildable llama-moe preset): Qwen3-30B-A3B (Qwen3 technical report, 2025; 30.5B / 3.3B; 128-wide heads
    # at d 2048, with q/k norms) and DeepSeek-V3
    # (DeepSeek-AI, 2024, arXiv 2412.19437; 671B / 37B; 256 routed experts and 1 shared, top-8, the first 3
    # layers dense, multi-head latent attention with its published ranks, each token routed within 4 of 8
    # expert groups (``topk_group``/``n_group``: at most 4 nodes, 2.1.2); without the multi-token-prediction
    # module, which the 671B leaves out too).
    "qwen3-30b-a3b": dataclasses.replace(_llama_moe(48, 2048, 32, 4, 6144, 151936, experts=128, top_k=8,
                                                    d_ff_expert=768), head_dim=128, qk_norm=True),
    "deepseek-v3": dataclasses.replace(
        _llama_moe(61, 7168, 128, 128, 18432, 129280, experts=256, top_k=8, d_ff_expert=2048, shared=1,
                   dense_layers=3),
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        expert_groups=8, groups_per_token=4),
}


def _all_shapes() -> dict[str, ModelShape]:
    """The registry's shapes and :data:`PLANNING_SHAPES` under one set of names, each defined once."""
    registered = planner_shapes()
    twice = registered.keys() & PLANNING_SHAPES.keys()
    if twice:
        raise ValueError(f"model shapes {sorted(twice)} are defined both in trainmesh.models and in PLANNING_SHAPES")
    return registered | PLANNING_SHAPES


MODEL_PRESETS: dict[str, ModelShape] = _all_shapes()


def model_shape(name: str) -> ModelShape:
    """Look a model preset up by name, with the list of valid names in the error."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}") from None
