"""A Llama-family decoder (Touvron et al., 2023; Llama 3, Grattafiori et al., 2024) as a plain ``nn.Module``.

Pre-norm RMSNorm, RoPE (rotate-half, after the projection so positions stay global), SwiGLU, GQA, no biases; GPT's
stage contract. ``attn.qkv`` rows are grouped by KV head (Megatron-LM's GQA layout, so tp hands out whole groups)
and ``mlp.gate_up`` is one fused ``[gate | up]`` linear."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.models.cache import KVCache, LayerCache, causal_attention
from trainmesh.models.documents import current_documents, token_positions
from trainmesh.models.moe import MoEConfig, layer_mlp
from trainmesh.models.rope import RopeScaling, attention_factor, inverse_frequencies, rope_from_hf, rope_to_hf, \
    softmax_gain
from trainmesh.models.spec import HFIncompatible, HFMapping, ModelShape, explicit_head_dim, stage_forward


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama: GQA when ``n_kv_heads < n_heads``; ``moe`` (Mixtral, Qwen3-MoE, DeepSeek-V3), ``qkv_bias``
    (Qwen2), ``qk_norm`` (Qwen3), ``sliding_window`` (Mistral), ``kv_lora_rank`` (:class:`LatentAttention`),
    ``head_dim`` and ``rope_scaling`` (:mod:`trainmesh.models.rope`) for the families built on it. Gemma 3's:
    every ``global_every``-th layer attends over everything, the others in the window with ``local_rope_theta``
    (unscaled); ``query_pre_attn_scalar`` replaces the head size in the softmax scale; RMSNorm gains ``1 + w``
    (``norm_offset``), norms after attention and MLP too (``sandwich_norm``), embeddings times sqrt(d_model)
    (``embed_scale``), ``mlp_act`` the gate's activation (:data:`ACTIVATIONS`). GPT-OSS's:
    ``attention_sinks``, ``o_bias`` and ``alternate_window`` (the window on even layers only)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    moe: MoEConfig | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    head_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    global_every: int = 0
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    norm_offset: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    mlp_act: str = "silu"
    attention_sinks: bool = False
    o_bias: bool = False
    alternate_window: bool = False

    def is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within the sliding window."""
        return self.sliding_window is not None and not (self.global_every and (layer + 1) % self.global_every == 0) \
            and not (self.alternate_window and layer % 2)

    @property
    def head_size(self) -> int:
        """Width of one query, key or value head: ``head_dim``, else ``d_model / n_heads``."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def shape(self) -> ModelShape:
        """The planner's view: gated MLP, no biases, RMSNorm, no learned positions, GQA."""
        experts = {} if self.moe is None else self.moe.shape_fields()
        return ModelShape(self.n_layers, self.d_model, self.n_heads, self.d_ff, self.vocab_size, self.seq_len,
                          gated_mlp=True, bias=False, learned_positions=False, n_kv_heads=self.n_kv_heads,
                          tied_embeddings=self.tie_embeddings, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                          sandwich_norm=self.sandwich_norm,
                          sliding_window=self.sliding_window,
                          global_every=2 if self.alternate_window else self.global_every,
                          kv_lora_rank=self.kv_lora_rank,
                          q_lora_rank=self.q_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim,
                          qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim,
                          head_dim=self.head_dim, sinks=self.attention_sinks,
                          expert_biases=bool(self.moe and self.moe.biases), **experts)

    def n_params(self) -> int:
        return self.shape().n_params()


PRESETS: dict[str, LlamaConfig] = {
    # Sized like the tiny GPT (d 64, vocab 256, 4x MLP width in parameters) with 4 layers for pp tests.
    "llama-tiny": LlamaConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256,
                              seq_len=64, rope_theta=10000.0),
    "llama-small": LlamaConfig(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=688, vocab_size=256,
                               seq_len=128, rope_theta=10000.0),
}

MOE_PRESETS: dict[str, LlamaConfig] = {
    # Eight SwiGLU experts of hidden 48, two per token, plus one shared expert (Qwen/DeepSeek-style), on a
    # two-layer llama-tiny body.
    "llama-moe-tiny": LlamaConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=256,
                                  seq_len=32, rope_theta=10000.0,
                                  moe=MoEConfig(n_experts=8, top_k=2, d_ff_expert=48, n_shared_experts=1)),
}

# Llama 3 / 3.1 shapes (Grattafiori et al., 2024, Table 3): 128,256-token vocabulary, 8 KV heads, untied
# head, 8K context for the planner. Llama 1 7B (Touvron et al., 2023, Table 2) is multi-head, 32K vocabulary.
PLANNER_PRESETS: dict[str, LlamaConfig] = {
    "llama-7b": LlamaConfig(32, 4096, 32, 32, 11008, 32000, 2048, rope_theta=10000.0),
    "llama3-8b": LlamaConfig(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": LlamaConfig(80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": LlamaConfig(126, 16384, 128, 8, 53248, 128256, 8192),
}


# Mixtral-8x7B (Jiang et al., 2024; its Hugging Face config): 46.7B parameters, 12.9B active; planned at
# 4096 tokens, as the MoE shapes of the planner.
MOE_PLANNER_PRESETS: dict[str, LlamaConfig] = {
    "mixtral-8x7b": LlamaConfig(32, 4096, 32, 8, 14336, 32000, 4096, rope_theta=1e6,
                                moe=MoEConfig(n_experts=8, top_k=2, d_ff_expert=14336)),
}


class RMSNorm(nn.Module):
    """x / rms(x) * g (Zhang & Sennrich, 2019), normalised in at least fp32 whatever the compute dtype; with
    ``offset`` the gain is ``1 + g`` and ``g`` starts at 0 (Gemma's)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * (1 + self.weight if self.offset else self.weight)


def rotary_angles_at(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                     scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position p times frequency theta^(-2i/head_dim) (scaled by ``scaling``), each
    ``[*positions.shape, head_dim]`` with the ``head_dim/2`` frequencies repeated for the two halves (Su et al.,
    2021, RoFormer, eq. 34), both multiplied by the scaling's attention factor (YaRN's temperature)."""
    wide = torch.promote_types(dtype, torch.float32)
    inv_freq = inverse_frequencies(head_dim, theta, scaling, wide, positions.device)
    angles = positions.to(wide).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    factor = attention_factor(scaling)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def rotary_angles(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device,
                  scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_angles_at` positions ``0 .. seq_len-1``."""
    return rotary_angles_at(torch.arange(seq_len, device=device), head_dim, theta, dtype, scaling)


class Rotary(nn.Module):
    """The rotary angles of given position ids, a parameter-free module so cp can hand it the tokens' global positions
    and get the angles a single process computes; per-sequence ids (``[batch, t]``, packed documents) give
    ``[batch, 1, t, head_dim]`` angles, broadcast over heads."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary_angles_at(positions, self.head_dim, self.theta, dtype, self.scaling)
        return (cos, sin) if positions.dim() == 1 else (cos.unsqueeze(-3), sin.unsqueeze(-3))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i + d/2}) of ``x`` (``[..., seq, head_dim]``) by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Sinks(nn.Module):
    """One learned logit per query head (GPT-OSS's attention sinks), its own module so tp splits it by heads."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


class AttentionCore(nn.Module):
    """Causal softmax attention of query heads over their shared KV heads, within ``window`` when set, with
    ``n_sinks`` heads' sinks when set, within each packed document (:mod:`~trainmesh.models.documents`); its own module so selective recomputation [KOR, §5] redoes exactly this
    and cp finds its window."""

    def __init__(self, window: int | None = None, n_sinks: int = 0) -> None:
        super().__init__()
        self.window = window
        self.sinks = Sinks(n_sinks) if n_sinks else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        documents = current_documents()
        return causal_attention(q, k, v, self.window, documents=documents,
                                sinks=None if self.sinks is None else self.sinks())


class Attention(nn.Module):
    """GQA with rotary positions; layer ``layer``'s window and rope base (:meth:`LlamaConfig.is_local`). The
    queries carry any ``query_pre_attn_scalar`` scale, so the core (and cp's ring) keep ``1/sqrt(head_dim)``."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.head_dim, self.group = cfg.head_size, cfg.group
        local = cfg.is_local(layer)
        self.core = AttentionCore(cfg.sliding_window if local else None, cfg.n_heads if cfg.attention_sinks else 0)
        own_base = local and cfg.local_rope_theta is not None
        self.rope = Rotary(cfg.head_size, *((cfg.local_rope_theta, None) if own_base else
                                            (cfg.rope_theta, cfg.rope_scaling)))
        self.theta = self.rope.theta
        self.query_gain = (cfg.head_size / cfg.query_pre_attn_scalar) ** 0.5 if cfg.query_pre_attn_scalar else 1.0
        heads = cfg.n_heads * cfg.head_size
        self.qkv = nn.Linear(cfg.d_model, heads + 2 * cfg.n_kv_heads * cfg.head_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(heads, cfg.d_model, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(cfg.head_size, cfg.norm_eps, cfg.norm_offset) for _ in "qk")

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t, _ = qkv.shape  # the whole sequence even when x is a sequence-parallel slice
        groups = qkv.view(b, t, -1, self.group + 2, self.head_dim)
        q = groups[..., : self.group, :].reshape(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = (groups[..., i, :].transpose(1, 2) for i in (self.group, self.group + 1))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        start = 0 if cache is None else cache.length
        cos, sin = self.rope(token_positions(start, t, q.device), q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.query_gain != 1.0:
            q = q * self.query_gain
        if cache is not None:
            k, v = cache.extend(k, v)
        y = self.core(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 §2.1, eq. 14-19): keys and values expanded (``kv_b``) from one
    compressed vector per token, queries through a ``q_lora_rank`` bottleneck, a decoupled shared rotary part; tp
    splits heads. YaRN's ``mscale_all_dim`` scales the queries, so the core keeps its ``1/sqrt(d)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.nope, self.rope_dim, self.rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.v_dim, qk = cfg.v_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk, bias=False)
        else:
            self.q = nn.Linear(cfg.d_model, cfg.n_heads * qk, bias=False)
        self.kv_a = nn.Linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.kv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.d_model, bias=False)
        self.rope = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.core = AttentionCore(cfg.sliding_window)
        self.query_gain = softmax_gain(cfg.rope_scaling)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))) if hasattr(self, "q_a") else self.q(x)
        q = q.view(b, t, -1, self.nope + self.rope_dim).transpose(1, 2)
        latent, k_rot = self.kv_a(x).split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        start = 0 if cache is None else cache.length
        cos, sin = self.rope(token_positions(start, t, x.device), q.dtype)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary(q_rot, cos, sin)], dim=-1)
        if self.query_gain != 1.0:
            q = q * self.query_gain
        k_rot = apply_rotary(k_rot.unsqueeze(1), cos, sin).expand(b, k_nope.shape[1], t, self.rope_dim)
        k = torch.cat([k_nope, k_rot], dim=-1)
        if cache is not None:
            k, v = cache.extend(k, v)
        return self.o(self.core(q, k, v).transpose(1, 2).reshape(b, t, -1))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
"""The gate activations by ``LlamaConfig.mlp_act``: SwiGLU's, and GeGLU's tanh-approximated GELU (Gemma)."""


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), act SiLU or GELU (Shazeer, 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, d_model: int, d_ff: int, act: str = "silu") -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class Block(nn.Module):
    """Pre-norm attention and MLP residuals; with ``sandwich_norm`` each branch's output normed too (Gemma's)."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.attn = LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.mlp = layer_mlp(cfg.d_model, cfg.d_ff, cfg.moe, layer, functools.partial(SwiGLU, act=cfg.mlp_act),
                             gated=True)
        if cfg.sandwich_norm:
            self.attn_post_norm, self.mlp_post_norm = (RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
                                                       for _ in "am")

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        out = self.attn(self.attn_norm(x), cache)
        x = x + (self.attn_post_norm(out) if hasattr(self, "attn_post_norm") else out)
        out = self.mlp(self.mlp_norm(x))
        return x + (self.mlp_post_norm(out) if hasattr(self, "mlp_post_norm") else out)


class TokenEmbedding(nn.Embedding):
    """Token ids to vectors, times ``scale`` in their dtype when set (Gemma's sqrt(d_model); tp's vocabulary-split
    table keeps it). Positions enter attention by rotation, so the ``start`` position that the stage contract
    hands every embedding when decoding with a cache changes nothing here."""

    scale: float | None = None

    def forward(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        out = super().forward(ids)
        return out if self.scale is None else out * torch.tensor(self.scale, dtype=out.dtype)


class Llama(nn.Module):
    """``embed -> blocks -> ln_f -> head``; ``forward`` returns logits (hidden states on a middle stage)."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        self.embed.scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.ln_f: nn.Module | None = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.head: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters(seed)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init: N(0, 0.02) matrices, output projections scaled by 1/sqrt(2L), gains 1, biases 0, from a private
        generator so the weights depend on the seed alone in every layout."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(0.0 if self.cfg.norm_offset else 1.0)
            else:
                residual = ("attn.o.weight", "mlp.down.weight", "shared.down.weight", "experts.w2")
                std = residual_std if name.endswith(residual) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return stage_forward(self, x, cache)


TP_PLAN: dict[str, str] = {
    "embed": "vocab",
    "blocks.*.attn_norm": "sequence",
    "blocks.*.mlp_norm": "sequence",
    "blocks.*.attn.qkv": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.gate_up": "colwise_pair",
    "blocks.*.mlp.down": "rowwise",
    "ln_f": "sequence",
    "head": "vocab",
}
"""Megatron-LM's split of a Llama: the grouped fused qkv by whole KV groups, ``o`` and ``down`` by input
features, ``[gate | up]`` chunk by chunk, embedding and head by vocabulary; the RMSNorms replicated, in the
sequence-parallel region under SP."""


# --- Hugging Face LlamaForCausalLM ---------------------------------------------------------------------

def from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``LlamaForCausalLM`` config (its ``head_dim`` kept); anything computed differently
    (activation, biases, a RoPE scaling but linear, llama3 or yarn) is refused."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    differs = {"hidden_act": (hf.get("hidden_act"), "silu"), "attention_bias": (bool(hf.get("attention_bias")), False),
               "mlp_bias": (bool(hf.get("mlp_bias")), False)}
    for what, (there, ours) in differs.items():
        if there != ours:
            raise HFIncompatible(f"{what} is {there!r}; trainmesh's Llama has {ours!r} (RMSNorm, SwiGLU, no "
                                 f"biases), so this checkpoint cannot be imported")
    theta, scaling = rope_from_hf(hf)
    return LlamaConfig(n_layers=hf["num_hidden_layers"], d_model=d, n_heads=heads,
                       n_kv_heads=hf.get("num_key_value_heads") or heads, d_ff=hf["intermediate_size"],
                       vocab_size=hf["vocab_size"], seq_len=hf["max_position_embeddings"],
                       rope_theta=theta, norm_eps=float(hf["rms_norm_eps"]),
                       tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       head_dim=explicit_head_dim(d, heads, hf.get("head_dim")), rope_scaling=scaling)


OPTIONS = {"qkv_bias": "q/k/v biases", "qk_norm": "q/k norms", "sliding_window": "a sliding window",
           "kv_lora_rank": "latent attention", "attention_sinks": "attention sinks", "o_bias": "an o bias"}
"""The attention options of :class:`LlamaConfig` that not every architecture has a place for."""


def refuse_options(cfg: LlamaConfig, architecture: str, allowed: tuple[str, ...] = ()) -> None:
    """An :class:`HFIncompatible` for an attention option of ``cfg`` that ``architecture`` cannot hold."""
    for option, what in OPTIONS.items():
        if getattr(cfg, option) and option not in allowed:
            raise HFIncompatible(f"this model has {what} ({option}={getattr(cfg, option)!r}), which {architecture} "
                                 f"has no place for; it cannot be written as one")


def to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """The ``LlamaConfig`` attributes of ours; no special tokens, since trainmesh trains on raw bytes."""
    refuse_options(cfg, "LlamaForCausalLM")
    return {"hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_size,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "bos_token_id": None, "eos_token_id": None,
            **rope_to_hf(cfg.rope_scaling)}


def fuse_qkv(cfg: LlamaConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF's separate ``q_proj``/``k_proj``/``v_proj`` rows in our KV-group order: per KV head ``g``, its query heads,
    then K_g, then V_g (biases as one-column weights)."""
    if q.dim() == 1:
        return fuse_qkv(cfg, q[:, None], k[:, None], v[:, None])[:, 0]
    d = q.shape[1]
    groups = [q.reshape(cfg.n_kv_heads, cfg.group * cfg.head_size, d),
              k.reshape(cfg.n_kv_heads, cfg.head_size, d), v.reshape(cfg.n_kv_heads, cfg.head_size, d)]
    return torch.cat(groups, dim=1).reshape(-1, d)


def split_qkv(cfg: LlamaConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_qkv`."""
    if qkv.dim() == 1:
        return tuple(t[:, 0] for t in split_qkv(cfg, qkv[:, None]))
    groups = qkv.reshape(cfg.n_kv_heads, cfg.group + 2, cfg.head_size, qkv.shape[1])
    q = groups[:, : cfg.group].reshape(-1, qkv.shape[1])
    return q, groups[:, cfg.group].reshape(-1, qkv.shape[1]), groups[:, cfg.group + 1].reshape(-1, qkv.shape[1])


def _layer_names(cfg: LlamaConfig, i: int) -> dict[str, str]:
    """Our name -> HF's, for the one-to-one tensors of layer ``i`` outside its MLP (Qwen3's q/k norms, Gemma's
    four norms a layer too)."""
    ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
    norms = {ours + f"attn.{x}_norm.weight": theirs + f"self_attn.{x}_norm.weight" for x in "qk"} if cfg.qk_norm else {}
    if cfg.sandwich_norm:
        norms |= {ours + "attn_post_norm.weight": theirs + "post_attention_layernorm.weight",
                  ours + "mlp_post_norm.weight": theirs + "post_feedforward_layernorm.weight"}
    mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norm else "post_attention_layernorm"
    return {ours + "attn_norm.weight": theirs + "input_layernorm.weight",
            ours + "attn.o.weight": theirs + "self_attn.o_proj.weight",
            ours + "mlp_norm.weight": theirs + f"{mlp_norm}.weight", **norms}


def _top_names(cfg: LlamaConfig) -> dict[str, str]:
    names = {"embed.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}
    return names if cfg.tie_embeddings else {**names, "head.weight": "lm_head.weight"}


Tensors = Mapping[str, torch.Tensor]
LayerMap = Callable[[LlamaConfig, Tensors, int], dict[str, torch.Tensor]]


def dense_mlp_from_hf(cfg: LlamaConfig, hf: Tensors, i: int) -> dict[str, torch.Tensor]:
    mlp = f"model.layers.{i}.mlp."
    return {f"blocks.{i}.mlp.gate_up.weight": torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]),
            f"blocks.{i}.mlp.down.weight": hf[mlp + "down_proj.weight"]}


def dense_mlp_to_hf(cfg: LlamaConfig, ours: Tensors, i: int) -> dict[str, torch.Tensor]:
    mlp = f"model.layers.{i}.mlp."
    gate, up = ours[f"blocks.{i}.mlp.gate_up.weight"].chunk(2)
    return {mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up,
            mlp + "down_proj.weight": ours[f"blocks.{i}.mlp.down.weight"]}


def _from_hf(cfg: LlamaConfig, hf: Tensors, mlp_from_hf: LayerMap) -> dict[str, torch.Tensor]:
    """Our state dict from a Llama-layout one whose MLPs ``mlp_from_hf`` maps: only the KV-group fusion re-lays
    attention out (HF's q/k rows are rotate-half already); a tied checkpoint's ``lm_head.weight`` must be the
    embedding."""
    out = {ours: hf[theirs] for ours, theirs in _top_names(cfg).items()}
    head = hf["lm_head.weight"] if cfg.tie_embeddings and "lm_head.weight" in hf else None
    if head is not None and not head.is_meta and not torch.equal(head, out["embed.weight"]):
        raise HFIncompatible("tie_word_embeddings is true but lm_head.weight differs from the embedding; set "
                             "tie_word_embeddings to false in config.json to import both")
    for i in range(cfg.n_layers):
        out.update({ours: hf[theirs] for ours, theirs in _layer_names(cfg, i).items()})
        attn = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[f"blocks.{i}.attn.qkv.{kind}"] = fuse_qkv(cfg, *(hf[attn + f"{x}_proj.{kind}"] for x in "qkv"))
        out.update(mlp_from_hf(cfg, hf, i))
    return out


def _to_hf(cfg: LlamaConfig, ours: Tensors, mlp_to_hf: LayerMap) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_from_hf` (no ``lm_head.weight`` when tied: transformers ties it)."""
    out = {theirs: ours[name] for name, theirs in _top_names(cfg).items()}
    for i in range(cfg.n_layers):
        out.update({theirs: ours[name] for name, theirs in _layer_names(cfg, i).items()})
        attn = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = split_qkv(cfg, ours[f"blocks.{i}.attn.qkv.{kind}"])
            out.update({attn + f"q_proj.{kind}": q, attn + f"k_proj.{kind}": k, attn + f"v_proj.{kind}": v})
        out.update(mlp_to_hf(cfg, ours, i))
    return {name: t.contiguous() for name, t in out.items()}


def from_hf(cfg: LlamaConfig, hf: Tensors) -> dict[str, torch.Tensor]:
    """Our state dict from a ``LlamaForCausalLM`` one (:func:`_from_hf`; ``gate``/``up`` fused)."""
    return _from_hf(cfg, hf, dense_mlp_from_hf)


def to_hf(cfg: LlamaConfig, ours: Tensors) -> dict[str, torch.Tensor]:
    """The ``LlamaForCausalLM`` state dict of ours."""
    return _to_hf(cfg, ours, dense_mlp_to_hf)


ROTARY_BUFFERS = r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"

HF_MAPPING = HFMapping("LlamaForCausalLM", "llama", from_hf_config, to_hf_config, from_hf, to_hf,
                       buffers=ROTARY_BUFFERS)


# --- Hugging Face MixtralForCausalLM -------------------------------------------------------------------

def mixtral_from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """Our config for a ``MixtralForCausalLM`` config: softmax-routed SwiGLU experts with renormalised top-k weights;
    sliding windows and router jitter are refused."""
    for what, ours in (("sliding_window", None), ("router_jitter_noise", 0.0)):
        if hf.get(what) not in (ours, 0):
            raise HFIncompatible(f"{what} is {hf.get(what)!r}; trainmesh's Llama has {ours!r}, so this Mixtral "
                                 f"cannot be imported")
    cfg = from_hf_config(hf)
    moe = MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    d_ff_expert=hf["intermediate_size"], aux_coef=float(hf.get("router_aux_loss_coef", 0.01)))
    return dataclasses.replace(cfg, moe=moe)


def mixtral_to_hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """The ``MixtralConfig`` attributes of ours; refused where Mixtral has no place for what ours computes
    (shared experts, dense leading layers, sigmoid scores, unnormalised top-k, group-limited routing)."""
    m = cfg.moe
    differs = {"n_shared_experts": (m.n_shared_experts, 0), "n_dense_layers": (m.n_dense_layers, 0),
               "score": (m.score, "softmax"), "normalize_top_k": (m.normalize_top_k, True),
               "group_limited": (m.group_limited, False)}
    for what, (here, theirs) in differs.items():
        if here != theirs:
            raise HFIncompatible(f"{what} is {here!r}; MixtralForCausalLM has {theirs!r}, so this model cannot be "
                                 f"written as one")
    attributes = {k: v for k, v in to_hf_config(cfg).items() if k not in ("attention_bias", "mlp_bias")}
    return {**attributes, "intermediate_size": m.d_ff_expert, "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_coef, "sliding_window": None,
            "router_jitter_noise": 0.0}


def _expert_names(i: int, e: int) -> tuple[str, str, str]:
    prefix = f"model.layers.{i}.block_sparse_moe.experts.{e}."
    return prefix + "w1.weight", prefix + "w3.weight", prefix + "w2.weight"


def moe_from_hf(cfg: LlamaConfig, hf: Tensors, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and experts, stacked into our ``[E, d, f]``/``[E, f, d]``, from Mixtral's saved
    layout (``block_sparse_moe``, per-expert ``w1``/``w2``/``w3``) or transformers' fused in-memory one."""
    ours, fused = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
    if fused + "gate.weight" in hf:
        w1, w3 = hf[fused + "experts.gate_up_proj"].transpose(1, 2).chunk(2, dim=2)
        return {ours + "router.gate.weight": hf[fused + "gate.weight"], ours + "experts.w1": w1.contiguous(),
                ours + "experts.w3": w3.contiguous(),
                ours + "experts.w2": hf[fused + "experts.down_proj"].transpose(1, 2).contiguous()}
    return stack_experts(cfg, hf, i, _expert_names, f"model.layers.{i}.block_sparse_moe.gate.weight")


ExpertNames = Callable[[int, int], tuple[str, str, str]]


def stack_experts(cfg: LlamaConfig, hf: Tensors, i: int, names: ExpertNames, router: str) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router (HF tensor ``router``) and experts, stored one by one as ``save_pretrained`` writes
    them (``names(i, e)``: expert ``e``'s gate ``[f, d]``, up ``[f, d]`` and down ``[d, f]``), stacked into our
    ``[E, d, f]``/``[E, f, d]`` ``w1``, ``w3``, ``w2``."""
    per_expert = [names(i, e) for e in range(cfg.moe.n_experts)]
    w1, w3, w2 = (torch.stack([hf[n[k]] for n in per_expert]).transpose(1, 2).contiguous() for k in range(3))
    ours = f"blocks.{i}.mlp."
    return {ours + "router.gate.weight": hf[router], ours + "experts.w1": w1, ours + "experts.w3": w3,
            ours + "experts.w2": w2}


def refuse_routing_bias(ours: Tensors, i: int, architecture: str) -> None:
    """For an ``architecture`` whose router has no selection bias, a bias the aux-loss-free update has moved
    would change which experts layer ``i`` picks, so it is refused."""
    bias = ours.get(f"blocks.{i}.mlp.router.expert_bias")
    if bias is not None and bias.count_nonzero():
        raise HFIncompatible(f"the routers carry a load-balancing bias (--moe-bias-rate), which {architecture}'s "
                             f"router has no place for; train without --moe-bias-rate to export as one")


def unstack_experts(cfg: LlamaConfig, ours: Tensors, i: int, names: ExpertNames, router: str,
                    architecture: str | None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`stack_experts` (:func:`refuse_routing_bias` for an ``architecture``)."""
    if architecture:
        refuse_routing_bias(ours, i, architecture)
    out = {router: ours[f"blocks.{i}.mlp.router.gate.weight"]}
    for e in range(cfg.moe.n_experts):
        for name, key in zip(names(i, e), ("w1", "w3", "w2")):
            out[name] = ours[f"blocks.{i}.mlp.experts.{key}"][e].t()
    return out


def moe_to_hf(cfg: LlamaConfig, ours: Tensors, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s experts in Mixtral's checkpoint layout (the inverse of :func:`moe_from_hf`)."""
    return unstack_experts(cfg, ours, i, _expert_names, f"model.layers.{i}.block_sparse_moe.gate.weight",
                           "MixtralForCausalLM")


def mixtral_from_hf(cfg: LlamaConfig, hf: Tensors) -> dict[str, torch.Tensor]:
    """Our state dict from a ``MixtralForCausalLM`` one."""
    return _from_hf(cfg, hf, moe_from_hf)


def mixtral_to_hf(cfg: LlamaConfig, ours: Tensors) -> dict[str, torch.Tensor]:
    """The ``MixtralForCausalLM`` state dict of ours, experts one by one as ``save_pretrained`` writes them."""
    return _to_hf(cfg, ours, moe_to_hf)


MIXTRAL_MAPPING = HFMapping("MixtralForCausalLM", "mixtral", mixtral_from_hf_config, mixtral_to_hf_config,
                            mixtral_from_hf, mixtral_to_hf, buffers=ROTARY_BUFFERS)
