"""Forward FLOPs per token of a block (dense or MoE): 2 per matmul weight plus 4sh for QK^T and AV
[NAR, app. FLOPs], as :func:`trainmesh.tracking.metrics.block_flops_per_token` counts, so MFU agrees."""

from __future__ import annotations

from trainmesh.tracking.metrics import block_flops_per_token
from trainmesh.models.spec import ModelShape


def attention_weights(m: ModelShape) -> int:
    """Weights of one attention layer's matmuls: its parameters without biases and inner norms."""
    if not m.latent_attention:
        return (m.qkv_width + m.attention_width) * m.d_model
    return m.attention_params() - m.q_lora_rank - m.kv_lora_rank  # less the two latent RMSNorms


def core_width(m: ModelShape) -> tuple[int, int]:
    """(query/key width, value width) per head: the attention core's QK^T and AV inner dimensions. Latent
    attention's queries and keys carry a rotary part besides the compressed one [DeepSeek-V2, 2.1]."""
    if not m.latent_attention:
        return m.head_size, m.head_size
    return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim


def attention_forward_flops(m: ModelShape, seq_len: int) -> float:
    """Forward FLOPs of one attention layer per token, the mean over the layers: 2 per weight, and QK^T and AV
    over ``seq_len`` keys (2 s H (d_qk + d_v); 4sh for plain heads, as [NAR, app. FLOPs] counts it, causal mask or
    not); a layer within a sliding window shorter than the sequence counts its ``window`` keys instead."""
    qk, v = core_width(m)
    keys = seq_len + m.local_layers * (min(seq_len, m.sliding_window or seq_len) - seq_len) / m.n_layers
    return 2 * attention_weights(m) + 2 * keys * m.n_heads * (qk + v)


def block_forward_flops(m: ModelShape, seq_len: int, moe: bool = False) -> int:
    """Forward FLOPs of one block per token; an MoE block counts active parameters (``top_k`` routed plus shared
    experts and the router). Without latent attention this is
    :func:`trainmesh.tracking.metrics.block_flops_per_token`."""
    width = (m.top_k + m.n_shared_experts) * m.expert_ff if moe else m.d_ff
    router = 2 * m.d_model * m.n_experts if moe else 0
    plain = block_flops_per_token(m.d_model, width, seq_len, m.gated_mlp, m.qkv_width, m.attention_width)
    if not m.latent_attention:
        return plain + router
    mlp = plain - block_flops_per_token(m.d_model, 0, seq_len, m.gated_mlp, m.qkv_width, m.attention_width)
    return attention_forward_flops(m, seq_len) + mlp + router


def is_moe_layer(m: ModelShape, layer: int) -> bool:
    """Whether block ``layer`` (from 0) holds experts: all after the first ``n_dense_layers`` of an MoE model."""
    return m.n_experts > 0 and layer >= m.n_dense_layers
