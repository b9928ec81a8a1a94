"""The registry of model families: each is a :class:`~trainmesh.models.spec.ModelSpec`, looked up by preset
name (``--model``). Registering a family here is all it takes for ``trainmesh train`` and ``plan`` to offer
its presets; no parallel form names a model class."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from trainmesh.models import gpt, hf_llama, llama
from trainmesh.models.moe import MoEConfig
from trainmesh.models.spec import ModelShape, ModelSpec, Staged, StageLayout


def gpt_shape(cfg: gpt.ModelConfig) -> ModelShape:
    """The planner's view of a built-in GPT (:meth:`trainmesh.models.gpt.ModelConfig.shape`)."""
    return cfg.shape()


GPT_PLAN: dict[str, str] = {
    "embed.tok": "vocab",
    "embed.pos": "sequence_scatter",
    "blocks.*.ln*": "sequence",
    "blocks.*.attn.qkv": "colwise_qkv",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "ln_f": "sequence",
    "head": "vocab",
}
"""The plan for :class:`trainmesh.models.gpt.GPT` (Megatron-LM's layout, Korthikanti et al.'s regions)."""


GPT_BF16 = ("embed", "embed.*", "head")
LLAMA_BF16 = ("embed", "head")
ROUTER = "blocks.*.mlp.router*"
"""The layers that stay bf16 under ``--precision fp8`` (:attr:`ModelSpec.high_precision`): the token (and
position) embeddings, the output head and, in MoE models, the router, whose top-k choice flips on small
score changes (torchtitan and DeepSeek-V3's FP8 recipe keep the same ones in high precision)."""


def without_mlp(plan: dict[str, str]) -> dict[str, str]:
    """A family's plan for its mixture-of-experts models: the router and the experts stay whole on every tp
    rank (expert parallelism, not tensor parallelism, is what splits experts), the rest as in ``plan``."""
    return {pattern: style for pattern, style in plan.items() if ".mlp." not in pattern}


def is_moe(cfg: object) -> bool:
    return getattr(cfg, "moe", None) is not None


def config_from_dict(like: Any, values: dict[str, Any]) -> Any:
    """A model config of ``like``'s type from its ``dataclasses.asdict`` form (a checkpoint manifest's), its
    MoE settings made a :class:`~trainmesh.models.moe.MoEConfig` again."""
    moe = values.get("moe")
    return type(like)(**{**values, **({"moe": MoEConfig(**moe)} if moe else {})})

def build_hf_llama(config: Any, seed: int) -> nn.Module:
    """A ``transformers.LlamaForCausalLM`` of ``config``, initialised from ``seed`` (the global generator
    is left as it was)."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec("gpt", gpt.PRESETS, gpt.GPT, GPT_PLAN,
              {"full": (gpt.Block,), "selective": (gpt.AttentionCore,)}, gpt_shape, hf=gpt.HF_MAPPING,
              cp_plan={"embed.pos": "positions", "blocks.*.attn.core": "attention"}, high_precision=GPT_BF16,
              accepts=lambda model: isinstance(model, gpt.GPT) and not is_moe(model.cfg)),
    ModelSpec("llama", llama.PRESETS, llama.Llama, llama.TP_PLAN,
              {"full": (llama.Block,), "selective": (llama.AttentionCore,)}, llama.LlamaConfig.shape,
              planner_presets=llama.PLANNER_PRESETS, hf=llama.HF_MAPPING,
              cp_plan={"blocks.*.attn.rope": "positions", "blocks.*.attn.core": "attention"},
              high_precision=LLAMA_BF16,
              accepts=lambda model: isinstance(model, llama.Llama) and not is_moe(model.cfg)),
    ModelSpec("gpt-moe", gpt.MOE_PRESETS, gpt.GPT, without_mlp(GPT_PLAN),
              {"full": (gpt.Block,), "selective": (gpt.AttentionCore,)}, gpt_shape,
              cp_plan={"embed.pos": "positions", "blocks.*.attn.core": "attention"},
              high_precision=(*GPT_BF16, ROUTER), accepts=lambda model: isinstance(model, gpt.GPT) and is_moe(model.cfg)),
    ModelSpec("llama-moe", llama.MOE_PRESETS, llama.Llama, without_mlp(llama.TP_PLAN),
              {"full": (llama.Block,), "selective": (llama.AttentionCore,)}, llama.LlamaConfig.shape,
              planner_presets=llama.MOE_PLANNER_PRESETS, hf=llama.MIXTRAL_MAPPING,
              cp_plan={"blocks.*.attn.rope": "positions", "blocks.*.attn.core": "attention"},
              high_precision=(*LLAMA_BF16, ROUTER),
              accepts=lambda model: isinstance(model, llama.Llama) and is_moe(model.cfg)),
    ModelSpec("hf-llama", {}, build_hf_llama, hf_llama.PLAN, hf_llama.RECOMPUTE, hf_llama.shape,
              accepts=hf_llama.accepts, layout=hf_llama.layout, config_of=hf_llama.config_of,
              prepare=hf_llama.add_rotary, high_precision=("model.embed_tokens", "lm_head")),
)

class _PresetNames(Collection):
    """Every preset ``trainmesh train`` can build (full-sized ones included), read from the registry at each
    use, so a preset added to a family's table later (a user's, or a test's) is a valid ``--model`` too."""

    def __iter__(self) -> Iterator[str]:
        return (name for spec in SPECS for name in (*spec.presets, *spec.planner_presets))

    def __contains__(self, name: object) -> bool:
        return any(name in spec.presets or name in spec.planner_presets for spec in SPECS)

    def __len__(self) -> int:
        return sum(len(spec.presets) + len(spec.planner_presets) for spec in SPECS)


PRESET_NAMES = _PresetNames()


def _find(name: str) -> tuple[ModelSpec, Any]:
    for spec in SPECS:
        presets = {**spec.presets, **spec.planner_presets}
        if name in presets:
            return spec, presets[name]
    raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


def spec_for(model: nn.Module) -> ModelSpec | None:
    """The registered family ``model`` belongs to (its spec's ``accepts``), or None for a model of none."""
    return next((spec for spec in SPECS if spec.accepts(model)), None)


def spec_of(name: str) -> ModelSpec:
    """The family of a buildable preset, with the valid names in the error."""
    return _find(name)[0]


def preset(name: str) -> Any:
    """The config of a buildable preset, with the valid names in the error."""
    return _find(name)[1]


def family(name: str) -> ModelSpec:
    """The registered family called ``name`` (a checkpoint records its model's family by this name)."""
    for spec in SPECS:
        if spec.family == name:
            return spec
    raise ValueError(f"unknown model family {name!r}; trainmesh has {', '.join(s.family for s in SPECS)}")


def any_config(spec: ModelSpec) -> Any:
    """A config of ``spec``'s family (its first preset), whose type and fields stand for every config of it:
    what a checkpoint's config is read back as, and checked against."""
    return next(iter({**spec.presets, **spec.planner_presets}.values()))


def register_preset(spec: ModelSpec, name: str, cfg: Any) -> None:
    """Make ``name`` a buildable preset of ``spec``'s family with config ``cfg``, for this process: how a model
    that is no preset (an ``--init-hf`` import, a model a script saved) is named and built by ``trainmesh
    train``. Re-registering a name with the same config is a no-op; with another, an error."""
    presets = {**spec.presets, **spec.planner_presets}
    if name in presets and presets[name] != cfg:
        raise ValueError(f"model preset {name!r} exists with another config; choose another name")
    spec.presets[name] = cfg


def planner_shapes() -> dict[str, ModelShape]:
    """Every preset's shape, planner-only ones included, by name."""
    return {name: spec.shape(cfg) for spec in SPECS for name, cfg in {**spec.presets, **spec.planner_presets}.items()}


__all__ = ["config_from_dict", "is_moe", "GPT_PLAN", "ModelShape", "ModelSpec", "SPECS", "PRESET_NAMES", "StageLayout", "Staged", "spec_for",
           "spec_of", "preset", "planner_shapes", "family", "register_preset", "any_config"]
