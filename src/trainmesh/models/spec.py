"""A model family as data: builder, tensor-parallel plan, recompute targets and planner shape, so adding an
architecture touches no parallel form (as torchtitan's ``TrainSpec``). Models keep GPT's stage contract (``embed``,
``blocks``, ``ln_f``, ``head``, any None on a stage); other models are presented in it by :class:`Staged`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainmesh.models.cache import KVCache


def stage_forward(model: nn.Module, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """``embed -> blocks -> ln_f -> head``, skipping what this stage does not hold. With a ``cache``
    (decoding), ``x`` holds the tokens after the cached positions and each block extends its layer's cache."""
    if model.embed is not None:
        x = model.embed(x) if cache is None else model.embed(x, cache.length)
    for name, block in model.blocks.items():
        x = block(x) if cache is None else block(x, cache.layers[name])
    if model.ln_f is not None:
        x = model.ln_f(x)
    if model.head is not None:
        x = model.head(x)
    return x


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, found up to its square root: the planner takes those of up to a
    million ranks in its inner loops."""
    low = [d for d in range(1, math.isqrt(max(n, 0)) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def explicit_head_dim(d_model: int, n_heads: int, head_dim: int | None) -> int | None:
    """``head_dim`` as a config field holds it: None where it is ``d_model / n_heads`` anyway (or not given),
    so a model whose config.json spells out the usual width equals the one that leaves it out."""
    return None if head_dim in (None, 0) or head_dim * n_heads == d_model else head_dim


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a decoder-only transformer (defaults: trainmesh's GPT; ``bias=False``:
    LLaMA-style); variants as in :class:`~trainmesh.models.llama.LlamaConfig`; ``head_dim`` None means ``d_model /
    n_heads``; ``sinks``: GPT-OSS's per-head sinks and o bias, ``expert_biases``: its router's and experts' biases;
    ``global_every``: every n-th layer attends to the whole sequence, the others within ``sliding_window`` (Gemma 3:
    6, GPT-OSS's alternating layers: 2; 0, every layer within it)."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    gated_mlp: bool = False
    bias: bool = True
    learned_positions: bool = True
    dropout: bool = False
    flash_attention: bool = True
    n_kv_heads: int | None = None
    tied_embeddings: bool = False
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    d_ff_expert: int | None = None
    n_dense_layers: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    sliding_window: int | None = None
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    head_dim: int | None = None
    expert_groups: int = 0
    groups_per_token: int = 0
    sinks: bool = False
    expert_biases: bool = False
    global_every: int = 0

    def __post_init__(self) -> None:
        if self.groups_per_token and not (self.n_experts % self.expert_groups == 0
                                          and self.groups_per_token <= self.expert_groups):
            raise ValueError(f"groups_per_token={self.groups_per_token} of expert_groups={self.expert_groups}: the "
                             f"groups must divide n_experts={self.n_experts} and a token can pick at most all of them")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose n_heads in {divisors(self.d_model)}, or give head_dim"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.kv_heads} does not divide n_heads={self.n_heads}; "
                             f"choose n_kv_heads in {divisors(self.n_heads)}")
        if self.n_experts and not (1 <= self.top_k <= self.n_experts and self.n_dense_layers <= self.n_layers):
            raise ValueError(f"top_k={self.top_k} of n_experts={self.n_experts} with n_dense_layers="
                             f"{self.n_dense_layers} of n_layers={self.n_layers}: a token picks 1 to n_experts "
                             f"experts and at most every layer is dense")
        if self.latent_attention and not (self.qk_nope_head_dim + self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError(f"kv_lora_rank={self.kv_lora_rank} (latent attention) needs heads: give qk_nope_head_dim "
                             f"or qk_rope_head_dim, and v_head_dim, of at least 1")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def local_layers(self) -> int:
        """Layers attending within ``sliding_window``: all of them, or all but every ``global_every``-th."""
        if self.sliding_window is None:
            return 0
        return self.n_layers - (self.n_layers // self.global_every if self.global_every else 0)

    @property
    def head_size(self) -> int:
        """Width of one query, key or value head: ``head_dim``, else ``d_model / n_heads``."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def attention_width(self) -> int:
        """Width of all query heads together: the query projection's output, the output projection's input."""
        return self.n_heads * self.head_size

    @property
    def qkv_width(self) -> int:
        """Output features of the fused q/k/v projection: n_heads * head_dim for queries, 2 * kv_heads *
        head_dim for K and V."""
        return (self.n_heads + 2 * self.kv_heads) * self.head_size

    def tp_sizes(self) -> dict[str, int]:
        """Sizes that tensor parallelism splits, so tp must divide each (:mod:`trainmesh.layout` says so); key/value
        heads first, since under grouped-query attention they are the fewest (every tp rank needs whole heads)."""
        sizes = {"n_kv_heads": self.kv_heads} if self.kv_heads != self.n_heads else {}
        return {**sizes, "n_heads": self.n_heads, "d_ff": self.d_ff, "vocab_size": self.vocab_size}

    @property
    def expert_ff(self) -> int:
        """Hidden size of one expert's MLP."""
        return self.d_ff if self.d_ff_expert is None else self.d_ff_expert

    def mlp_params(self, d_ff: int, biases: bool) -> int:
        """One MLP of hidden size ``d_ff`` (gated: two input projections), with or without its biases."""
        d, inputs = self.d_model, 2 if self.gated_mlp else 1
        return (inputs + 1) * d * d_ff + ((inputs * d_ff + d) if biases and self.bias else 0)

    def expert_params(self) -> int:
        """One routed expert: its MLP, and its biases where it has them (GPT-OSS's)."""
        biases = (2 if self.gated_mlp else 1) * self.expert_ff + self.d_model if self.expert_biases else 0
        return self.mlp_params(self.expert_ff, False) + biases

    def moe_params(self) -> int:
        """One MoE layer: router, routed experts and the shared experts' MLP."""
        shared = self.mlp_params(self.n_shared_experts * self.expert_ff, True) if self.n_shared_experts else 0
        return (self.d_model + self.expert_biases) * self.n_experts + self.n_experts * self.expert_params() + shared

    @property
    def latent_attention(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> int:
        """One attention layer's projections (and, for Qwen3 and latent attention, its inner norms)."""
        d = self.d_model
        if self.latent_attention:
            qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            queries = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.n_heads * qk_dim
                       if self.q_lora_rank else d * self.n_heads * qk_dim)
            latent = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            keys_values = self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return queries + latent + keys_values + self.n_heads * self.v_head_dim * d
        biases = (self.qkv_width + d) if self.bias or self.sinks else self.qkv_width if self.qkv_bias else 0
        biases += self.n_heads if self.sinks else 0
        return d * self.qkv_width + self.attention_width * d + biases + (2 * self.head_size if self.qk_norm else 0)

    @property
    def block_norm_params(self) -> int:
        """One block's norms outside attention: two, four with norms after attention and MLP too (Gemma's)."""
        return (4 if self.sandwich_norm else 2) * self.d_model * (2 if self.bias else 1)

    def n_params(self) -> int:
        """Total parameter count: every block, the embeddings, the final norm and the (untied) head."""
        d = self.d_model
        norm = d * (2 if self.bias else 1)
        attention = self.attention_params()
        dense = self.block_norm_params + attention + self.mlp_params(self.d_ff, True)
        moe_layers = self.n_layers - self.n_dense_layers if self.n_experts else 0
        blocks = self.n_layers * dense + moe_layers * (self.moe_params() - self.mlp_params(self.d_ff, True))
        embed = self.vocab_size * d + (self.seq_len * d if self.learned_positions else 0)
        head = 0 if self.tied_embeddings else d * self.vocab_size
        return blocks + embed + norm + head


RecomputeTargets = Mapping[str, tuple[type[nn.Module] | str, ...]]

CONTRACT = ("embed", "blocks", "ln_f", "head")


@dataclass(frozen=True)
class StageLayout:
    """Module paths of the stage contract's parts: ``blocks`` (``"model.layers"``), ``pre`` before them,
    ``post`` after (final norm then head); the model must compute ``post(blocks(pre(x)))``."""

    blocks: str
    pre: str | None = None
    post: tuple[str, ...] = ()
    hidden_size: int = 0

    def __post_init__(self) -> None:
        if len(self.post) > 2:
            raise ValueError(f"StageLayout.post names {len(self.post)} modules {list(self.post)}; give at most "
                             f"two (the final norm, then the output head)")

    def paths(self) -> dict[str, str | None]:
        """Contract name -> module path (None: the model has no such part)."""
        norm = self.post[0] if len(self.post) == 2 else None
        head = self.post[-1] if self.post else None
        return {"embed": self.pre, "blocks": self.blocks, "ln_f": norm, "head": head}


def _set_path(root: nn.Module, path: str, value: nn.Module | None) -> None:
    """Put ``value`` at ``path`` (the plain ``nn.Module`` assignment, past :class:`Staged`'s contract names)."""
    parent, _, child = path.rpartition(".")
    nn.Module.__setattr__(root.get_submodule(parent) if parent else root, child, value)


class Staged(nn.Module):
    """A model presented in the stage contract without renaming: it holds the model's own children, so
    parameter names, checkpoints and TP plans stay the model's; blocks become a ModuleDict by layer index."""

    def __init__(self, model: nn.Module, layout: StageLayout) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_paths", layout.paths())
        object.__setattr__(self, "layout", layout)
        for part, path in self._paths.items():
            if path is not None:
                self._module_at(path, part)
        blocks = self.get_submodule(layout.blocks)
        if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"StageLayout.blocks {layout.blocks!r} is a {type(blocks).__name__}; it must name the "
                             f"nn.ModuleList (or ModuleDict) of the model's blocks")
        _set_path(self, layout.blocks, nn.ModuleDict(dict(blocks.named_children())))

    def _module_at(self, path: str, part: str) -> nn.Module:
        try:
            return self.get_submodule(path)
        except AttributeError:
            names = [n for n, _ in self.named_modules() if n and n.count(".") < 2]
            raise ValueError(f"StageLayout names {path!r} as the {part}, but the model has no such module; "
                             f"its modules include {', '.join(names[:8])}") from None

    def _part(self, part: str) -> nn.Module | None:
        """The module at ``part``'s path; None where a pipeline stage does not hold it."""
        module: nn.Module | None = self
        for name in (self._paths[part] or "").split("."):
            module = module._modules.get(name) if module is not None and name else None
        return module

    def __getattr__(self, name: str):
        if name in CONTRACT:
            return self._part(name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name not in CONTRACT:
            super().__setattr__(name, value)
        elif self._paths[name] is not None:
            _set_path(self, self._paths[name], value)
        elif value is not None:
            raise ValueError(f"the model has no {name} in its StageLayout; it cannot be given one")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stage_forward(self, x)


Tensors = Mapping[str, torch.Tensor]


class HFIncompatible(ValueError):
    """A Hugging Face config or state that a family cannot take, or a model it cannot be written as; the
    message is one line saying what differs and what to do."""


@dataclass(frozen=True)
class HFMapping:
    """How a family meets Hugging Face transformers, as data and pure functions (no transformers import):
    config.json's ``architecture``/``model_type``, ``from_config``/``to_config`` (or :class:`HFIncompatible`),
    ``from_hf``/``to_hf`` renaming state dicts both ways, and ``buffers``, a regex of non-weight tensors."""

    architecture: str
    model_type: str
    from_config: Callable[[Mapping[str, Any]], Any]
    to_config: Callable[[Any], dict[str, Any]]
    from_hf: Callable[[Any, Tensors], dict[str, torch.Tensor]]
    to_hf: Callable[[Any, Tensors], dict[str, torch.Tensor]]
    buffers: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """One model family: presets (CPU sizes), ``planner_presets`` (published shapes), builder, tp plan, recompute
    targets, planner shape and :class:`HFMapping`; families outside the stage contract add ``accepts``, ``layout``,
    ``config_of`` and ``prepare`` for :class:`Staged` (:func:`trainmesh.register_family`)."""

    family: str
    presets: Mapping[str, Any]
    builder: Callable[[Any, int], nn.Module]
    tp_plan: Mapping[str, str]
    recompute: RecomputeTargets
    shape: Callable[[Any], ModelShape]
    planner_presets: Mapping[str, Any] = field(default_factory=dict)
    accepts: Callable[[nn.Module], bool] = lambda model: False
    layout: Callable[[nn.Module], StageLayout] | None = None
    config_of: Callable[[nn.Module], Any] = lambda model: model.cfg
    prepare: Callable[[nn.Module], None] = lambda model: None
    holds: Callable[[Any], bool] | None = None
    """Whether a model config is of this family (None: it has the type of the family's presets and, like
    them, experts or none): how a config is matched to its family where several share one config type."""

    hf: HFMapping | None = None
    cp_plan: Mapping[str, str] = field(default_factory=dict)
    """Context parallelism's view (``context_parallel.apply_context_parallel``): the attention cores
    (``attention``) and the modules taking position ids (``positions``); empty: cp cannot split this family."""
    documents: bool = False
    """Whether the family's attention cores and position modules read packed documents
    (:mod:`trainmesh.models.documents`), so it trains on a batch that carries them."""
    high_precision: tuple[str, ...] = ()
    """Module-name patterns (as in ``tp_plan``) of the layers that keep computing in bf16 under
    ``precision="fp8"``: the embedding, the output head, an MoE router (:mod:`trainmesh.training.float8` turns every
    other ``nn.Linear`` into a float8 one); empty: the family does not train in fp8."""
