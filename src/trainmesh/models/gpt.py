"""A GPT-style decoder written as a plain ``nn.Module`` that knows nothing of parallelism.

Parallel forms are applied *to* this model from outside (see ``trainmesh.parallelize``). Two choices make
that possible without special cases:

* attention derives its head count from the width of the tensors it receives, so a tensor-parallel plan
  can shard the ``qkv``/``proj`` linears and each rank then computes ``n_heads / tp`` heads;
* the blocks live in an ``nn.ModuleDict`` keyed by layer index and every top-level piece may be removed
  (set to ``None``), so a pipeline stage is this same class with the layers it does not own deleted,
  and parameter names stay identical across layouts (which sharded checkpoints rely on). torchtitan
  builds its pipeline stages the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.models.cache import KVCache, LayerCache, causal_attention
from trainmesh.models.spec import stage_forward


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT: GPT-2 layout (pre-norm, learned positions, biases), untied output head."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_params(self) -> int:
        """Exact parameter count of :class:`GPT` with this shape (the planner relies on it)."""
        d, f, v, s = self.d_model, self.d_ff, self.vocab_size, self.seq_len
        per_block = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        return v * d + s * d + self.n_layers * per_block + 2 * d + d * v


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32),
    # tiny with 8 layers, for pipeline tests: pp=4 with 2 interleaved chunks per rank needs 8 stages.
    "tiny-deep": ModelConfig(n_layers=8, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32),
    "small": ModelConfig(n_layers=4, d_model=256, n_heads=8, d_ff=1024, vocab_size=256, seq_len=128),
    # GPT-2 small's shape; the vocabulary is padded to a multiple of 128 as Megatron does. With byte tokens
    # only the first 256 rows are ever used, but the FLOPs and memory are GPT-2's.
    "gpt2-124m": ModelConfig(n_layers=12, d_model=768, n_heads=12, d_ff=3072, vocab_size=50304, seq_len=1024),
}


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d))V with a causal mask: parameter-free, its own module so that selective
    activation recomputation (Korthikanti et al., 2022, §5) can recompute exactly this part."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v)


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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding; one module so a pipeline's first stage owns both."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Embed tokens at positions ``start, start + 1, ...`` (``start`` > 0 when a cache holds the earlier ones)."""
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class GPT(nn.Module):
    """Decoder-only transformer: ``embed -> blocks -> ln_f -> head``; ``forward`` returns logits.

    Any of ``embed``, ``ln_f`` and ``head`` may be ``None`` and ``blocks`` may hold a subset of layers:
    the input is then hidden states instead of token ids and the output hidden states instead of logits.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embedding(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f: nn.Module | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 init (N(0, 0.02), residual projections scaled by 1/sqrt(2L)) from a private generator.

        A private generator makes the weights a function of the seed alone, identical on every rank and in
        every layout, without touching the global RNG that dropout or data code may use.
        """
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / (2 * self.cfg.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return stage_forward(self, x, cache)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every position; the default criterion (TP swaps in a vocab-parallel one)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 logits: loss in fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
