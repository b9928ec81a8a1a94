"""The registry of model families (:class:`~trainmesh.models.spec.ModelSpec`, looked up by preset name):
registering one, here or by :func:`register_family` or the ``trainmesh.families`` entry points, is all
``train``, ``plan``, ``--init-hf``, ``export --hf`` and ``parallelize`` need."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn

from trainmesh.models import deepseek, gemma, gpt, gpt_oss, hf_llama, llama, mistral, qwen
from trainmesh.models.moe import MoEConfig
from trainmesh.models.rope import RopeScaling
from trainmesh.models.spec import HFMapping, ModelShape, ModelSpec, Staged, StageLayout


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


def is_moe(cfg: object) -> bool:
    return getattr(cfg, "moe", None) is not None


def config_from_dict(like: Any, values: dict[str, Any]) -> Any:
    """A model config of ``like``'s type from its ``dataclasses.asdict`` form (a manifest's), with its ``MoEConfig``
    and ``RopeScaling`` rebuilt."""
    moe, rope = values.get("moe"), values.get("rope_scaling")
    return type(like)(**{**values, **({"moe": MoEConfig(**moe)} if moe else {}),
                         **({"rope_scaling": RopeScaling(**rope)} if rope else {})})

def hf_builder(architecture: str) -> Callable[[Any, int], nn.Module]:
    """A builder of transformers' ``architecture`` from its config, initialised from ``seed`` (the global
    generator is left as it was)."""
    def build(config: Any, seed: int) -> nn.Module:
        import transformers

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return getattr(transformers, architecture)(config)
    return build


def hf_family(architecture: str) -> ModelSpec:
    """transformers' own ``architecture`` object (Llama and its variants) as a family: the Python API
    parallelizes it as it is (:mod:`trainmesh.models.hf_llama`)."""
    name = "hf-" + hf_llama.ARCHITECTURES[architecture].lower()
    return ModelSpec(name, {}, hf_builder(architecture), hf_llama.plan(architecture), hf_llama.recompute(architecture),
                     hf_llama.shape, accepts=hf_llama.accepts_class(architecture), layout=hf_llama.layout,
                     config_of=hf_llama.config_of, prepare=hf_llama.add_rotary, documents=True,
                     high_precision=("model.embed_tokens", "lm_head"))


def llama_variant(cfg: llama.LlamaConfig) -> str:
    """The family a Llama config belongs to, by its attention options (a Llama with none is a Llama, even one
    imported from a Mistral without a window: they compute the same)."""
    if cfg.kv_lora_rank:
        return "deepseek-v3"
    if cfg.attention_sinks:
        return "gpt-oss"
    if cfg.sandwich_norm:
        return "gemma3"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window else "llama"


LLAMA_RECOMPUTE = {"full": (llama.Block,), "selective": (llama.AttentionCore,)}
LLAMA_CP_PLAN = {"blocks.*.attn.rope": "positions", "blocks.*.attn.core": "attention"}


def llama_family(name: str, presets: dict, planner_presets: dict, tp_plan: dict[str, str],
                 hf: HFMapping, moe: bool = False) -> ModelSpec:
    """A family built on trainmesh's Llama (``moe``: of mixtures of experts), told apart from the others by
    :func:`llama_variant` (a Llama MoE is ``llama-moe``, a Qwen3 one ``qwen3-moe``)."""
    def holds(cfg: Any) -> bool:
        own = cfg.kv_lora_rank or cfg.attention_sinks  # DeepSeek-V3 and GPT-OSS are MoE families of their own
        variant = llama_variant(cfg) + "-moe" if moe and not own else llama_variant(cfg)
        return isinstance(cfg, llama.LlamaConfig) and is_moe(cfg) == moe and variant == name

    return ModelSpec(name, presets, llama.Llama, tp_plan, LLAMA_RECOMPUTE, llama.LlamaConfig.shape,
                     planner_presets=planner_presets, hf=hf, cp_plan=LLAMA_CP_PLAN, documents=True,
                     high_precision=(*LLAMA_BF16, ROUTER) if moe else LLAMA_BF16,
                     accepts=lambda model: isinstance(model, llama.Llama) and holds(model.cfg), holds=holds)


SPECS: list[ModelSpec] = [
    ModelSpec("gpt", gpt.PRESETS, gpt.GPT, GPT_PLAN,
              {"full": (gpt.Block,), "selective": (gpt.AttentionCore,)}, gpt_shape, hf=gpt.HF_MAPPING,
              cp_plan={"embed.pos": "positions", "blocks.*.attn.core": "attention"}, documents=True, high_precision=GPT_BF16,
              accepts=lambda model: isinstance(model, gpt.GPT) and not is_moe(model.cfg)),
    llama_family("llama", llama.PRESETS, llama.PLANNER_PRESETS, llama.TP_PLAN, llama.HF_MAPPING),
    llama_family("qwen2", qwen.QWEN2_PRESETS, qwen.QWEN2_PLANNER_PRESETS, llama.TP_PLAN, qwen.QWEN2_MAPPING),
    llama_family("qwen3", qwen.QWEN3_PRESETS, qwen.QWEN3_PLANNER_PRESETS, qwen.QWEN3_TP_PLAN, qwen.QWEN3_MAPPING),
    llama_family("mistral", mistral.PRESETS, mistral.PLANNER_PRESETS, llama.TP_PLAN, mistral.HF_MAPPING),
    llama_family("gemma3", gemma.PRESETS, gemma.PLANNER_PRESETS, gemma.TP_PLAN, gemma.HF_MAPPING),
    ModelSpec("gpt-moe", gpt.MOE_PRESETS, gpt.GPT, GPT_PLAN,
              {"full": (gpt.Block,), "selective": (gpt.AttentionCore,)}, gpt_shape,
              cp_plan={"embed.pos": "positions", "blocks.*.attn.core": "attention"}, documents=True,
              high_precision=(*GPT_BF16, ROUTER), accepts=lambda model: isinstance(model, gpt.GPT) and is_moe(model.cfg)),
    llama_family("llama-moe", llama.MOE_PRESETS, llama.MOE_PLANNER_PRESETS, llama.TP_PLAN,
                 llama.MIXTRAL_MAPPING, moe=True),
    llama_family("qwen3-moe", qwen.QWEN3_MOE_PRESETS, {}, qwen.QWEN3_TP_PLAN, qwen.QWEN3_MOE_MAPPING, moe=True),
    llama_family("deepseek-v3", deepseek.PRESETS, {}, deepseek.TP_PLAN, deepseek.HF_MAPPING, moe=True),
    llama_family("gpt-oss", gpt_oss.PRESETS, gpt_oss.PLANNER_PRESETS, gpt_oss.TP_PLAN, gpt_oss.HF_MAPPING, moe=True),
    *(hf_family(architecture) for architecture in hf_llama.ARCHITECTURES),
]


def register_family(spec: ModelSpec) -> ModelSpec:
    """Add ``spec``'s family for this process: its presets become ``--model`` names, ``parallelize`` recognises
    its models, its ``hf`` mapping serves ``--init-hf``/``export --hf``. A taken family, preset or
    architecture is refused (the same spec again is a no-op). Returns ``spec``."""
    if any(s is spec for s in SPECS):
        return spec
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register_family takes a trainmesh.ModelSpec, not a {type(spec).__name__}")
    if any(s.family == spec.family for s in SPECS):
        raise ValueError(f"model family {spec.family!r} exists; give the ModelSpec another family name")
    taken = [name for name in (*spec.presets, *spec.planner_presets) if name in PRESET_NAMES]
    if taken:
        raise ValueError(f"model preset {taken[0]!r} exists in another family; rename the preset")
    if spec.hf and any(s.hf and spec.hf.architecture == s.hf.architecture for s in SPECS):
        raise ValueError(f"{spec.hf.architecture} is read by trainmesh's own family; a family of it cannot be "
                         f"registered again")
    SPECS.append(spec)
    return spec


ENTRY_POINT_GROUP = "trainmesh.families"
_TRIED_ENTRY_POINTS: set[str] = set()  # loaded once per process, failures included, so each is said once


def load_installed_families() -> bool:
    """Register each family named in the ``trainmesh.families`` entry-point group (``"package.module:SPEC"``),
    only when a name is not found; one that fails to load is one stderr line. True if any was added."""
    added = False
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if point.value in _TRIED_ENTRY_POINTS:
            continue
        _TRIED_ENTRY_POINTS.add(point.value)
        try:
            register_family(point.load())
        except Exception as e:  # noqa: BLE001 - a broken package must not stop the families that load
            package = f" of {point.dist.name}" if point.dist is not None else ""
            reason = (str(e).splitlines() or [""])[0]
            print(f"trainmesh: entry point {point.name} = {point.value}{package} ({ENTRY_POINT_GROUP}) failed to "
                  f"load ({type(e).__name__}: {reason}); fix or uninstall that package", file=sys.stderr)
            continue
        added = True
    return added


class _PresetNames(Collection):
    """Every preset ``trainmesh train`` can build (full-sized ones included), read from the registry at each
    use, so a preset added to a family's table later (a user's, or a test's) is a valid ``--model`` too."""

    def __iter__(self) -> Iterator[str]:
        return (name for spec in SPECS for name in (*spec.presets, *spec.planner_presets))

    def __contains__(self, name: object) -> bool:
        def known() -> bool:
            return any(name in spec.presets or name in spec.planner_presets for spec in SPECS)
        return known() or (load_installed_families() and known())

    def __len__(self) -> int:
        return sum(len(spec.presets) + len(spec.planner_presets) for spec in SPECS)


PRESET_NAMES = _PresetNames()


def _find(name: str) -> tuple[ModelSpec, Any]:
    if name in PRESET_NAMES:  # an installed family's, loaded on the way
        spec = next(s for s in SPECS if name in s.presets or name in s.planner_presets)
        return spec, {**spec.presets, **spec.planner_presets}[name]
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
    if load_installed_families():
        return family(name)
    raise ValueError(f"unknown model family {name!r}; trainmesh has {', '.join(s.family for s in SPECS)}")


def any_config(spec: ModelSpec) -> Any:
    """A config of ``spec``'s family (its first preset), whose type and fields stand for every config of it:
    what a checkpoint's config is read back as, and checked against."""
    return next(iter({**spec.presets, **spec.planner_presets}.values()))


def register_preset(spec: ModelSpec, name: str, cfg: Any) -> None:
    """Make ``name`` a buildable preset of ``spec``'s family with config ``cfg`` for this process (how an
    ``--init-hf`` import or a saved model is built by ``train``); the same name with another config is an error."""
    presets = {**spec.presets, **spec.planner_presets}
    if name in presets and presets[name] != cfg:
        raise ValueError(f"model preset {name!r} exists with another config; choose another name")
    spec.presets[name] = cfg


def planner_shapes() -> dict[str, ModelShape]:
    """Every preset's shape, planner-only ones included, by name."""
    return {name: spec.shape(cfg) for spec in SPECS for name, cfg in {**spec.presets, **spec.planner_presets}.items()}


__all__ = ["config_from_dict", "is_moe", "GPT_PLAN", "ModelShape", "ModelSpec", "SPECS", "register_family",
           "llama_variant", "PRESET_NAMES", "StageLayout", "Staged", "spec_for",
           "spec_of", "preset", "planner_shapes", "family", "register_preset", "any_config",
           "load_installed_families", "ENTRY_POINT_GROUP"]
