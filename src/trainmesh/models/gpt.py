"""A GPT-style decoder as a plain ``nn.Module`` that knows nothing of parallelism: attention derives its head count from
its tensors' widths (so tp can shard it), and blocks are a ``ModuleDict`` whose pieces a pipeline stage deletes,
keeping names identical across layouts (as torchtitan)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.models.cache import KVCache, LayerCache, causal_attention
from trainmesh.models.documents import current_documents, token_positions
from trainmesh.models.moe import MoEConfig, layer_mlp
from trainmesh.models.spec import HFIncompatible, HFMapping, ModelShape, stage_forward


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT: GPT-2 layout (pre-norm, learned positions, biases), untied output head; with ``moe``,
    the MLP of every layer after ``moe.n_dense_layers`` is a mixture of GELU experts."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    moe: MoEConfig | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def shape(self) -> ModelShape:
        """The planner's view: every :class:`ModelShape` flag at its GPT-2-layout default."""
        experts = {} if self.moe is None else self.moe.shape_fields()
        return ModelShape(self.n_layers, self.d_model, self.n_heads, self.d_ff, self.vocab_size, self.seq_len,
                          **experts)

    def n_params(self) -> int:
        """Exact parameter count of :class:`GPT` with this shape (the planner relies on it)."""
        d, f, v, s = self.d_model, self.d_ff, self.vocab_size, self.seq_len
        mlp = (d * f + f) + (f * d + d)
        per_block = (3 * d * d + 3 * d) + (d * d + d) + mlp + 4 * d
        dense = v * d + s * d + self.n_layers * per_block + 2 * d + d * v
        if self.moe is None:
            return dense
        m = self.moe
        fs = m.n_shared_experts * m.d_ff_expert
        moe = d * m.n_experts + m.n_experts * 2 * d * m.d_ff_expert + ((2 * d * fs + fs + d) if fs else 0)
        return dense + (self.n_layers - m.n_dense_layers) * (moe - mlp)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32),
    # tiny with 8 layers, for pipeline tests: pp=4 with 2 interleaved chunks per rank needs 8 stages.
    "tiny-deep": ModelConfig(n_layers=8, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32),
    "small": ModelConfig(n_layers=4, d_model=256, n_heads=8, d_ff=1024, vocab_size=256, seq_len=128),
    # small with 8 layers, for the pipeline bench at pp=4: 2 interleaved chunks per rank need 8 stages.
    "small-deep": ModelConfig(n_layers=8, d_model=256, n_heads=8, d_ff=1024, vocab_size=256, seq_len=128),
    # GPT-2 small's shape; the vocabulary is padded to a multiple of 128 as Megatron does. With byte tokens
    # only the first 256 rows are ever used, but the FLOPs and memory are GPT-2's.
    "gpt2-124m": ModelConfig(n_layers=12, d_model=768, n_heads=12, d_ff=3072, vocab_size=50304, seq_len=1024),
    # GPT-2 XL's shape: the GPU check's larger model (24 GiB of fp32 weights, gradients and Adam state).
    "gpt2-1.5b": ModelConfig(n_layers=48, d_model=1600, n_heads=25, d_ff=6400, vocab_size=50304, seq_len=1024),
}

MOE_PRESETS: dict[str, ModelConfig] = {
    # tiny with its MLPs replaced by 8 GELU experts of a quarter the width, 2 per token (Switch/GShard-style
    # softmax router): as many active MLP weights per token as tiny has, four times as many in all.
    "moe-tiny": ModelConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32,
                            moe=MoEConfig(n_experts=8, top_k=2, d_ff_expert=64, normalize_top_k=False)),
}


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d))V with a causal mask (within each packed document, :mod:`~trainmesh.models.documents`):
    parameter-free, its own module so that selective activation recomputation (Korthikanti et al., 2022, §5) can
    recompute exactly this part."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, documents=current_documents())


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.core = AttentionCore()
        # Output features of qkv are laid out [q | k | v], each [n_heads, head_dim]: a tensor-parallel plan
        # shards each third by heads.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        # Shapes come from qkv's output: under sequence parallelism x holds a slice of the sequence and
        # the tensor-parallel qkv gathers the whole of it.
        b, t, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k, v = cache.extend(k, v)
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = layer_mlp(cfg.d_model, cfg.d_ff, cfg.moe, layer, MLP, gated=False)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding (positions restart at each packed document); one module so a pipeline's
    first stage owns both."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Embed tokens at positions ``start, start + 1, ...`` (``start`` > 0 when a cache holds the earlier ones)."""
        positions = token_positions(start, idx.shape[1], idx.device)
        return self.tok(idx) + self.pos(positions)


class GPT(nn.Module):
    """Decoder-only transformer: ``embed -> blocks -> ln_f -> head``; ``forward`` returns logits, or hidden
    states where ``embed``/``head`` are ``None`` on a stage."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embedding(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.ln_f: nn.Module | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init (N(0, 0.02), residual projections scaled by 1/sqrt(2L)) from a private generator, so the
        weights depend on the seed alone in every layout and the global RNG is untouched."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / (2 * self.cfg.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("proj.weight", "experts.w2")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return stage_forward(self, x, cache)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the trained positions (a target of -100, torch's ``ignore_index``, is not
    trained); the default criterion (TP swaps in a vocab-parallel one)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 logits: loss in fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- Hugging Face GPT2LMHeadModel ----------------------------------------------------------------------

TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new")
"""HF's names for the tanh approximation of GELU that :class:`MLP` computes: ``gelu_pytorch_tanh`` calls
the same ``F.gelu(approximate="tanh")``, ``gelu_new`` (GPT-2's own) spells out the same formula."""


def from_hf_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Our config for a ``GPT2LMHeadModel`` config; anything this model would compute differently (the exact
    erf GELU, another LayerNorm epsilon, attention scaled otherwise) is refused."""
    differs = {"activation_function": (hf.get("activation_function"), TANH_GELUS),
               "layer_norm_epsilon": (hf.get("layer_norm_epsilon"), (1e-5,)),
               "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
               "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
               "add_cross_attention": (hf.get("add_cross_attention", False), (False,))}
    for what, (there, ours) in differs.items():
        if there not in ours:
            raise HFIncompatible(f"{what} is {there!r}; trainmesh's GPT computes {ours[0]!r} (GPT-2 layout, "
                                 f"tanh GELU), so this checkpoint cannot be imported")
    d = hf["n_embd"]
    return ModelConfig(n_layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d,
                       vocab_size=hf["vocab_size"], seq_len=hf["n_positions"])


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``GPT2Config`` attributes of ours: untied head, no dropout (ours has none), no special tokens
    (trainmesh trains on raw bytes), and the GELU our MLP computes."""
    return {"n_layer": cfg.n_layers, "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "activation_function": TANH_GELUS[0],
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None}


CONV1D = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
"""Our linears that GPT-2 stores as ``Conv1D`` (weight ``[in, out]``, the transpose of ``nn.Linear``'s)."""
_HF_BLOCK = {"ln1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "ln2": "ln_2",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def _names(cfg: ModelConfig) -> dict[str, str]:
    """Our name -> HF's for every tensor but the head. q, k and v share one ``[q | k | v]`` projection
    in both, with heads in the same order, so nothing is re-laid out beyond the Conv1D transposes."""
    names = {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    for i in range(cfg.n_layers):
        for ours, theirs in _HF_BLOCK.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    return names


def _hf_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """Transposed if ``name`` (ours) is a Conv1D weight in GPT-2 (the transpose is its own inverse)."""
    return t.t().contiguous() if name.endswith(".weight") and name.rsplit(".", 1)[0].endswith(CONV1D) else t


def _hf_tensor(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """``name``, or the same without ``transformer.`` as ``GPT2Model`` checkpoints (OpenAI's own) store it."""
    return hf[name] if name in hf or not name.startswith("transformer.") else hf[name.removeprefix("transformer.")]


def from_hf(cfg: ModelConfig, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict from a GPT-2 one. Our head is its own weight: a tied checkpoint (GPT-2's usual, with
    no ``lm_head.weight``) gives it a copy of the token embedding, which computes the same logits."""
    out = {ours: _hf_layout(ours, _hf_tensor(hf, theirs)) for ours, theirs in _names(cfg).items()}
    out["head.weight"] = hf["lm_head.weight"] if "lm_head.weight" in hf else out["embed.tok.weight"].clone()
    return out


def to_hf(cfg: ModelConfig, ours: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``GPT2LMHeadModel`` state dict of ours, head untied (``tie_word_embeddings`` false)."""
    out = {theirs: _hf_layout(name, ours[name]) for name, theirs in _names(cfg).items()}
    return {**out, "lm_head.weight": ours["head.weight"]}


HF_MAPPING = HFMapping("GPT2LMHeadModel", "gpt2", from_hf_config, to_hf_config, from_hf, to_hf,
                       buffers=r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias")
