"""A model family as data: how to build it, how tensor parallelism splits it, what recomputation wraps,
and the shape the planner reasons about.

Nothing outside ``trainmesh.models`` names a model class: ``train.build`` looks the ``--model`` preset up
in the registry (:mod:`trainmesh.models`) and hands the spec's plan to ``tensor_parallel.parallelize`` and
its recompute targets to ``recompute.apply_recompute``, so adding an architecture touches no parallel form
(torchtitan's ``TrainSpec`` registers its model families the same way).

Every model a spec builds keeps the stage contract of :class:`trainmesh.models.gpt.GPT` that the pipeline
relies on: top-level ``embed``, ``blocks`` (an ``nn.ModuleDict`` keyed by layer index), ``ln_f`` and
``head``, any of ``embed``/``ln_f``/``head`` possibly ``None`` on a stage. For decoding with a
:class:`~trainmesh.models.cache.KVCache`, ``embed`` also takes the position its tokens start at and each
block the :class:`~trainmesh.models.cache.LayerCache` of its attention.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainmesh.models.cache import KVCache


def stage_forward(model: nn.Module, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """``embed -> blocks -> ln_f -> head``, skipping whatever this pipeline stage does not hold: a stage
    without ``embed`` takes hidden states, one without ``head`` returns them.

    With a ``cache`` (decoding), ``x`` holds the tokens after the ``cache.length`` positions already
    cached: the embedding is told where they start and each block reads and extends its layer's cache.
    Without one, every module is called exactly as in training."""
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
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a decoder-only transformer.

    The defaults describe trainmesh's own GPT (GPT-2 layout, no dropout, attention through
    ``scaled_dot_product_attention``, which never stores the s x s score matrix). ``bias=False`` means a
    LLaMA-style model: no biases anywhere and RMSNorm (one weight vector per norm). ``n_kv_heads`` below
    ``n_heads`` is grouped-query attention (None: one key/value head per query head);
    ``tied_embeddings`` means the output head reuses the token embedding's weight.
    """

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

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose n_heads in {divisors(self.d_model)}"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.kv_heads} does not divide n_heads={self.n_heads}; "
                             f"choose n_kv_heads in {divisors(self.n_heads)}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def qkv_width(self) -> int:
        """Output features of the fused q/k/v projection: d for queries, 2 * kv_heads * head_dim for K and V."""
        return self.d_model + 2 * self.kv_heads * (self.d_model // self.n_heads)

    def tp_sizes(self) -> dict[str, int]:
        """Sizes that tensor parallelism splits, so tp must divide each; key/value heads first, since under
        grouped-query attention they are the fewest (every tp rank needs whole heads)."""
        sizes = {"n_kv_heads": self.kv_heads} if self.kv_heads != self.n_heads else {}
        return {**sizes, "n_heads": self.n_heads, "d_ff": self.d_ff, "vocab_size": self.vocab_size}

    def split_error(self, tp: int, pp: int, name: str = "the model") -> str | None:
        """Why ``tp`` x ``pp`` cannot split this model, called ``name``, in one line with the valid choices;
        None if they can. Megatron-LM likewise refuses a tp that does not divide the KV heads."""
        sizes = self.tp_sizes()
        valid = [d for d in divisors(min(sizes.values())) if all(s % d == 0 for s in sizes.values())]
        for what, size in sizes.items():
            if size % tp:
                why = f"exceeds {what}={size} of {name} (each tp rank needs at least one)" if tp > size \
                    else f"does not divide {what}={size} of {name}"
                return f"tp={tp} {why}; choose tp in {{{', '.join(map(str, valid))}}}"
        if self.tied_embeddings and (tp > 1 or pp > 1):
            return (f"the output head of {name} shares the embedding's weight, which tp/pp would split apart; "
                    f"use tp=1 and pp=1 or a model with untied embeddings")
        return None

    def n_params(self) -> int:
        """Total parameter count: every block, the embeddings, the final norm and the (untied) head."""
        d, f = self.d_model, self.d_ff
        norm = d * (2 if self.bias else 1)
        biases = (self.qkv_width + d + f * (2 if self.gated_mlp else 1) + d) if self.bias else 0
        block = 2 * norm + d * self.qkv_width + d * d + (3 if self.gated_mlp else 2) * d * f + biases
        embed = self.vocab_size * d + (self.seq_len * d if self.learned_positions else 0)
        head = 0 if self.tied_embeddings else d * self.vocab_size
        return self.n_layers * block + embed + norm + head


RecomputeTargets = Mapping[str, tuple[type[nn.Module], ...]]
Tensors = Mapping[str, torch.Tensor]


class HFIncompatible(ValueError):
    """A Hugging Face config or state that a family cannot take, or a model it cannot be written as; the
    message is one line saying what differs and what to do."""


@dataclass(frozen=True)
class HFMapping:
    """How a family meets Hugging Face transformers, as data and pure functions (no transformers import):

    * ``architecture``/``model_type``: the ``architectures[0]`` and ``model_type`` of its ``config.json``;
    * ``from_config(hf)``: our config from the HF config's attributes (``PretrainedConfig.to_dict()``, so
      transformers has already filled in its defaults), or :class:`HFIncompatible` for anything our model
      would compute differently;
    * ``to_config(cfg)``: the HF config's attributes for one of ours (HFIncompatible where it has none);
    * ``from_hf(cfg, tensors)`` / ``to_hf(cfg, tensors)``: full state dicts renamed and re-laid-out (fused
      projections split or joined, transposed, tied weights dropped or copied), inverse of each other;
    * ``buffers``: a regular expression of names that older checkpoints store but that are no weights (a
      causal mask, RoPE frequencies); every other tensor of a checkpoint must be used.
    """

    architecture: str
    model_type: str
    from_config: Callable[[Mapping[str, Any]], Any]
    to_config: Callable[[Any], dict[str, Any]]
    from_hf: Callable[[Any, Tensors], dict[str, torch.Tensor]]
    to_hf: Callable[[Any, Tensors], dict[str, torch.Tensor]]
    buffers: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """One model family: its presets, how to build one, its tensor-parallel plan (module-name patterns ->
    ``tensor_parallel.STYLES``), the module classes each recompute mode checkpoints (``full``: whole blocks;
    ``selective``: the attention core), its shape for the planner, and how it maps to a Hugging Face
    architecture (:class:`HFMapping`, used by :mod:`trainmesh.hf`).

    ``planner_presets`` are shapes the planner knows but training on a CPU-sized machine would not build
    (an 8B model's weights alone exceed it); ``presets`` are the ones ``trainmesh train`` offers.
    """

    family: str
    presets: Mapping[str, Any]
    builder: Callable[[Any, int], nn.Module]
    tp_plan: Mapping[str, str]
    recompute: RecomputeTargets
    shape: Callable[[Any], ModelShape]
    planner_presets: Mapping[str, Any] = field(default_factory=dict)
    hf: HFMapping | None = None
    cp_plan: Mapping[str, str] = field(default_factory=dict)
    """Context parallelism's view (``context_parallel.apply_context_parallel``): the attention cores
    (``attention``) and the modules taking position ids (``positions``); empty: cp cannot split this family."""
