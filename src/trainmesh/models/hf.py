"""Hugging Face checkpoints in and out: a local ``transformers`` directory read into a trainmesh family, and a model
written so ``AutoModelForCausalLM.from_pretrained`` loads it. Per-family differences are data (``HFMapping``).
No pickle, no download, transformers imported lazily, nothing from a model folder executes (``auto_map`` refused,
``trust_remote_code=False``), weights finite floats (:mod:`trainmesh.models.weights`)."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from trainmesh.models import SPECS, is_moe, load_installed_families, spec_for
from trainmesh.models.spec import HFIncompatible, ModelSpec
from trainmesh.models.weights import FLOATING, first_untrainable, header_dtype_problem, scan_file
from trainmesh.storage.safe_io import UnreadableFile, read_user_file, replace_durably

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
CONFIG_LIMIT = 1 << 22  # a config.json is a few KB; 4 MiB bounds what is read from one
MAX_POSITIONS = 1 << 20  # as --seq-len's bound: rotary and position tables are sized to it
INT32_MAX = 2**31 - 1
MAX_EXPERTS = 1 << 12  # routed experts per layer: 16x DeepSeek-V3's 256, and a name list a check builds in ms
SIZES = {"n_layer": INT32_MAX, "n_embd": INT32_MAX, "n_head": INT32_MAX, "n_inner": INT32_MAX,
         "vocab_size": INT32_MAX, "n_positions": MAX_POSITIONS, "hidden_size": INT32_MAX,
         "intermediate_size": INT32_MAX, "num_hidden_layers": INT32_MAX, "num_attention_heads": INT32_MAX,
         "num_key_value_heads": INT32_MAX, "head_dim": INT32_MAX, "max_position_embeddings": MAX_POSITIONS,
         "num_local_experts": MAX_EXPERTS, "num_experts": MAX_EXPERTS, "n_routed_experts": MAX_EXPERTS,
         "num_experts_per_tok": MAX_EXPERTS, "moe_intermediate_size": INT32_MAX, "n_group": MAX_EXPERTS,
         "topk_group": MAX_EXPERTS, "kv_lora_rank": INT32_MAX, "q_lora_rank": INT32_MAX,
         "qk_rope_head_dim": INT32_MAX, "qk_nope_head_dim": INT32_MAX, "v_head_dim": INT32_MAX,
         "sliding_window": INT32_MAX}
"""The ``config.json`` keys the families read as sizes, each a whole number from 1 to its bound."""
COUNTS = {"n_shared_experts": MAX_EXPERTS, "first_k_dense_replace": INT32_MAX}
"""The keys read as counts that may be 0 (none): whole numbers from 0 to their bound."""
NULLABLE = ("n_inner", "head_dim", "num_key_value_heads", "q_lora_rank", "n_group", "topk_group",
            "n_shared_experts", "sliding_window")
"""The keys that may be ``null``: transformers or the family derives them, or null means none (no query
compression, no expert groups, no window)."""
SCALES = {"rope_theta": math.inf, "rms_norm_eps": math.inf, "layer_norm_epsilon": math.inf,
          "routed_scaling_factor": 1e3}
"""The keys the families read as positive finite numbers, each up to its bound: a routed output scaled by
1e308 overflows (DeepSeek's own factors are 1 to 16)."""
COEFFICIENTS = ("router_aux_loss_coef",)
"""The keys read as real numbers from 0 (a loss weight)."""
ROPE_DICTS = ("rope_parameters", "rope_scaling")
"""Where a config nests its rope settings (transformers 5, earlier); every number in them must be finite."""


class HFError(ValueError):
    """A Hugging Face directory that cannot be read or written; one line saying what to do."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise HFError("Hugging Face checkpoints need transformers; install it with pip install 'trainmesh[hf]'") \
            from None
    return transformers


def hf_dir(path: str | Path) -> Path:
    """``path`` if it is a local HF model directory trainmesh can read: it exists (a hub id does not, and is
    never downloaded), holds ``config.json`` and safetensors weights, not only pickled ones."""
    directory = Path(path)
    if not directory.exists():
        raise HFError(f"{path} does not exist; trainmesh never downloads, so if it is a hub id, download it "
                      f"first (huggingface-cli download {path} --local-dir DIR) and pass DIR")
    if not directory.is_dir():
        raise HFError(f"{path} is not a directory; pass the directory holding config.json and model.safetensors")
    if not (directory / CONFIG).is_file():
        raise HFError(f"{path} has no {CONFIG}; pass a directory written by save_pretrained")
    if not (directory / WEIGHTS).is_file() and not (directory / INDEX).is_file():
        if any((directory / name).exists() for name in PICKLED):
            raise HFError(f"{path} holds pytorch_model.bin (a pickle, which trainmesh never loads); convert it to "
                          f"safetensors first, e.g. save_pretrained(DIR, safe_serialization=True)")
        raise HFError(f"{path} has neither {WEIGHTS} nor {INDEX}; pass a directory written by save_pretrained")
    return directory


def _quoted(value: Any) -> str:
    """A value from a file, for a one-line message: plain names as they are, anything else as short JSON."""
    if isinstance(value, str) and re.fullmatch(r"[\w.\- ]+", value):
        return value
    return json.dumps(value)[:80]


def family_of(hf_config: Mapping[str, Any], where: str = "config.json") -> ModelSpec:
    """The family whose architecture ``hf_config`` names (``model_type``, else ``architectures``)."""
    architectures = hf_config.get("architectures") or []
    architectures = architectures if isinstance(architectures, list) else []
    for spec in SPECS:
        if spec.hf and (hf_config.get("model_type") == spec.hf.model_type or spec.hf.architecture in architectures):
            return spec
    if load_installed_families():
        return family_of(hf_config, where)
    known = ", ".join(f"{s.hf.architecture} ({s.hf.model_type})" for s in SPECS if s.hf)
    found = _quoted(hf_config.get("model_type") or architectures or "no model_type")
    raise HFError(f"{where} describes {found}; trainmesh imports {known}")


def _raw_config(path: Path) -> dict[str, Any]:
    """``config.json`` parsed as plain JSON (bounded, a regular file), before transformers reads it."""
    try:
        raw = json.loads(read_user_file(path, CONFIG_LIMIT))
    except UnreadableFile as e:
        raise HFError(str(e)) from None
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise HFError(f"{path} is not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(raw, dict):
        raise HFError(f"{path} holds {type(raw).__name__} JSON, not an object of settings")
    return raw


def _refuse_code(raw: dict[str, Any], path: Path) -> None:
    """Refuse an ``auto_map`` at any depth: it names Python classes in files beside the config, which
    transformers would import (after asking on the terminal, or at once when trusted)."""
    pending: list[Any] = [raw]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if "auto_map" in value:
                targets = value["auto_map"].values() if isinstance(value["auto_map"], dict) else [value["auto_map"]]
                names = [t for v in targets for t in (v if isinstance(v, list) else [v]) if isinstance(t, str)]
                files = sorted({n.split("--")[-1].rsplit(".", 1)[0] + ".py" for n in names})
                named = ", ".join(map(_quoted, files)) or "files it names"
                raise HFError(f"{path} has auto_map, which would run Python code from the model folder ({named}); "
                              f"trainmesh never runs code from a model folder: use a model of a built-in "
                              f"transformers architecture")
            pending += value.values()
        elif isinstance(value, list):
            pending += value


def check_config_values(raw: Mapping[str, Any], path: str | Path) -> None:
    """The sizes and scales the families read must be whole numbers in range and finite, so a bad ``n_layer`` or NaN
    ``rope_theta`` is one line naming the key before any tensor is built."""
    for key, bound in (*SIZES.items(), *COUNTS.items()):
        value, low = raw.get(key), 0 if key in COUNTS else 1
        if key not in raw or value is None and key in NULLABLE:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= bound:
            null = ", or null" if key in NULLABLE else ""
            raise HFError(f"{path}: {key} is {_shown(value)}; it must be a whole number from {low} to {bound:,}{null}")
    for key in (*SCALES, *COEFFICIENTS):
        if key in raw:
            _check_real(raw[key], key, key in COEFFICIENTS, path, SCALES.get(key, math.inf))
    for key in ROPE_DICTS:
        _check_rope(raw.get(key), key, path)


def _shown(value: Any) -> str:
    """A config value as its JSON (NaN and infinities as JSON writes them), cut short."""
    return json.dumps(value)[:40]


def _check_real(value: Any, key: str, zero: bool, path: str | Path, high: float = math.inf) -> None:
    """``value`` of ``key`` is a finite number above 0 (from 0 with ``zero``) up to ``high``, else an HFError
    naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (value >= 0 if zero else value > 0) or value > high:
        most = f" of at most {high:,g}" if high < math.inf else ""
        raise HFError(f"{path}: {key} is {_shown(value)}; it must be a {'' if zero else 'positive '}finite number"
                      f"{' (0 or more)' if zero else ''}{most}")


def _check_rope(value: Any, key: str, path: str | Path) -> None:
    """Every number in a rope dict (and the dicts nested in it, per layer type) finite, its ``rope_theta``
    positive: a rope of base -1 or NaN imports and then computes NaN in every forward pass."""
    if not isinstance(value, dict):
        return
    for name, item in value.items():
        where = f"{key}.{name}"
        if name == "rope_theta":
            _check_real(item, where, False, path)
        elif isinstance(item, dict):
            _check_rope(item, where, path)
        elif isinstance(item, float) and not math.isfinite(item):
            raise HFError(f"{path}: {where} is {_shown(item)}; it must be a finite number")


@functools.lru_cache(maxsize=8)
def _read_config(directory: Path) -> tuple[ModelSpec, Any]:
    path = directory / CONFIG
    raw = _raw_config(path)
    _refuse_code(raw, path)
    family_of(raw, str(path))
    check_config_values(raw, path)
    transformers = _transformers()
    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True,
                                                            trust_remote_code=False).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers parses a hostile file: its validators raise their own
        # types (huggingface_hub's StrictDataclassError is no ValueError), all of which mean "a bad config.json"
        raise HFError(f"{path} cannot be read by transformers: {' '.join(str(e).split())[:300]}") from None
    spec = family_of(hf_config, str(path))
    try:
        cfg = spec.hf.from_config(hf_config)
        spec.shape(cfg)
    except (HFIncompatible, ValueError, TypeError, ZeroDivisionError) as e:
        raise HFError(f"{path}: {e}") from None
    return spec, cfg


def read_config(path: str | Path) -> tuple[ModelSpec, Any]:
    """The family and model config of HF directory ``path``, from its ``config.json`` (read once per path)."""
    return _read_config(hf_dir(path).resolve())


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights: ``model.safetensors``, or every shard the index lists
    (plain file names inside the directory)."""
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    try:
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HFError(f"{directory / INDEX} is not a safetensors index with a weight_map ({e})") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise HFError(f"{directory / INDEX} lists {name!r}; shards must be .safetensors files in {directory}")
        if not (directory / name).is_file():
            raise HFError(f"{directory / INDEX} lists {name}, which is missing from {directory}")
    return [directory / name for name in names]


def _read_files(directory: Path, read: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        try:
            tensors = read(file)
        except (OSError, safetensors.SafetensorError) as e:
            raise HFError(f"{file} is not a readable safetensors file ({e})") from None
        repeated = out.keys() & tensors.keys()
        if repeated:
            raise HFError(f"{file} repeats tensor {sorted(repeated)[0]} of another shard of {directory}")
        out.update(tensors)
    return out


def _meta_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A file's tensors as meta tensors: names, shapes and dtypes from the header, no data read; a tensor
    that is not floating point is refused."""
    out = {}
    with safetensors.safe_open(file, framework="pt") as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            if problem := header_dtype_problem(name, dtype):
                raise HFError(f"{file}: {problem}")
            out[name] = torch.empty(f.get_slice(name).get_shape(), dtype=FLOATING[dtype], device="meta")
    return out


def _trainable_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A file's tensors, refused unless each is floating point and finite."""
    tensors = safetensors.torch.load_file(file)
    if problem := first_untrainable(tensors.items()):
        raise HFError(f"{file}: {problem}")
    return tensors


class _Reads(Mapping):
    """A read-only view of a state dict that remembers which names were read."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors, self.read = tensors, set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def to_trainmesh(spec: ModelSpec, cfg: Any, tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """An HF state dict as ours, through the family's mapping; a missing tensor, one left over (that no
    part of our model would hold) or shapes that do not fit ``config.json`` are one-line errors."""
    reads = _Reads(tensors)
    try:
        ours = spec.hf.from_hf(cfg, reads)
    except KeyError as e:
        raise HFError(f"{where} lacks tensor {e} that a {spec.hf.architecture} of its config.json has") from None
    except HFIncompatible as e:
        raise HFError(f"{where}: {e}") from None
    except RuntimeError as e:  # a fused projection that cannot be re-laid out: shapes differ from the config
        raise HFError(f"{where}: tensor shapes do not fit its config.json ({' '.join(str(e).split())})") from None
    unused = sorted(n for n in tensors if n not in reads.read and not re.fullmatch(spec.hf.buffers or "$^", n))
    if unused:
        raise HFError(f"{where} holds {len(unused)} tensor(s) trainmesh's {spec.family} of this config would not "
                      f"use (e.g. {unused[0]}); it is another architecture than its config.json says")
    _check_shapes(spec, cfg, ours, where)
    return ours


def _check_shapes(spec: ModelSpec, cfg: Any, ours: Mapping[str, torch.Tensor], where: str) -> None:
    """Every parameter of the model ``config.json`` describes has a tensor of its shape (mappings do not check every
    shape: a GPT-2 config missing ``n_embd`` gets 768 while its tensors are 16 wide)."""
    for name, shape in _parameter_shapes(spec.family, cfg).items():
        if name not in ours:
            raise HFError(f"{where} gives no tensor for {name} of a {spec.hf.architecture} of its config.json")
        if ours[name].shape != shape:
            raise HFError(f"{where}: {name} has shape {list(ours[name].shape)} but its config.json gives "
                          f"{list(shape)}; the config and the weights are of different models")


@functools.lru_cache(maxsize=8)
def _parameter_shapes(family: str, cfg: Any) -> dict[str, torch.Size]:
    """The parameter shapes of family ``family``'s model of ``cfg``, built on the meta device (no memory is
    allocated whatever its size; the build still takes ~50 ms, hence the cache)."""
    spec = next(s for s in SPECS if s.family == family)
    with torch.device("meta"):
        model = spec.builder(cfg, 0)
    return {name: p.shape for name, p in model.named_parameters()}


def check_weights(path: str | Path) -> tuple[ModelSpec, Any]:
    """Before any rank starts: the config is readable, the weight files' headers hold exactly the tensors
    the mapping needs, in floating point, and every tensor is finite (read one at a time)."""
    spec, cfg = read_config(path)
    directory = hf_dir(path)
    to_trainmesh(spec, cfg, _read_files(directory, _meta_tensors), str(directory))
    for file in weight_files(directory):
        try:
            problem = scan_file(file)
        except (OSError, safetensors.SafetensorError) as e:
            raise HFError(f"{file} is not a readable safetensors file ({e})") from None
        if problem:
            raise HFError(f"{file}: {problem}")
    return spec, cfg


def read_hf(path: str | Path) -> tuple[ModelSpec, Any, dict[str, torch.Tensor]]:
    """The family, model config and full weights (under our names) of HF directory ``path``."""
    spec, cfg = read_config(path)
    directory = hf_dir(path)
    return spec, cfg, to_trainmesh(spec, cfg, _read_files(directory, _trainable_tensors), str(directory))


def load_hf(model: nn.Module, path: str | Path) -> nn.Module:
    """Load HF directory ``path``'s weights into ``model`` (a trainmesh model of its family and shape, or a pipeline
    stage of one) before it is parallelized; ``train --init-hf`` reshards onto any layout itself. Returns ``model``."""
    spec, _, weights = read_hf(path)
    return _copy_in(model, spec, weights, path)


@torch.no_grad()
def _copy_in(model: nn.Module, spec: ModelSpec, weights: Mapping[str, torch.Tensor], path: Any) -> nn.Module:
    """``weights`` (of ``path``, under our names) into ``model``, each parameter's shape checked."""
    for name, p in model.named_parameters():
        if name not in weights or weights[name].shape != p.shape:
            there = "lacks it" if name not in weights else f"has shape {list(weights[name].shape)}"
            raise HFError(f"{path} does not fit this model: {name} of shape {list(p.shape)} here, {path} {there}; "
                          f"build the model from read_config({str(path)!r}) ({spec.family}) and load before "
                          f"parallelizing it")
        p.copy_(weights[name])
    for name, buffer in model.named_buffers():  # routing biases an import carries (DeepSeek-V3's)
        if name in weights:
            buffer.copy_(weights[name])
    return model


def _saved_form(model: nn.Module) -> dict[str, torch.Tensor]:
    """A transformers object's tensors under the names ``save_pretrained`` writes, which the families' mappings
    read (transformers 5 keeps experts fused in memory and unfuses them on saving)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the saved form is the one in memory
        return model.state_dict()
    return revert_weight_conversion(model, model.state_dict())


def from_hf(source: str | Path | nn.Module) -> nn.Module:
    """trainmesh's own model (its family's builder, in the weights' dtype) holding the weights of a local HF
    folder (config.json and safetensors; a hub id is refused, never downloaded) or of a transformers object."""
    if isinstance(source, nn.Module):
        hf_config = source.config.to_dict()
        spec = family_of(hf_config, type(source).__name__)
        cfg = spec.hf.from_config(hf_config)
        weights = to_trainmesh(spec, cfg, _saved_form(source), type(source).__name__)
    else:
        spec, cfg, weights = read_hf(source)
    return _copy_in(spec.builder(cfg, 0).to(next(iter(weights.values())).dtype), spec, weights, source)


def as_trainmesh(model: nn.Module) -> nn.Module:
    """A transformers object that no family takes as it is but one reads through its HF mapping (the MoE
    ones, GPT-2) as trainmesh's own model (:func:`from_hf`); any other model as it is."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not type(model).__module__.startswith("transformers.") or spec_for(model) is not None:
        return model
    return from_hf(model) if any(s.hf and s.hf.model_type == model_type for s in SPECS) else model


def spec_of_config(cfg: Any) -> ModelSpec:
    """The family whose presets have ``cfg``'s type (``gpt.ModelConfig``, ``llama.LlamaConfig``) and, like it,
    mixtures of experts or not."""
    for spec in SPECS:
        if spec.holds is not None:
            if spec.holds(cfg):
                return spec
        elif any(type(p) is type(cfg) and is_moe(p) == is_moe(cfg)
                 for p in (*spec.presets.values(), *spec.planner_presets.values())):
            return spec
    raise HFError(f"{type(cfg).__name__} is no trainmesh model family's config")


def _dtype_attribute(config: Any) -> str:
    """The config attribute naming the weights' dtype in the installed transformers: ``dtype`` where
    ``torch_dtype`` is only its deprecated alias (a property that warns), ``torch_dtype`` before that."""
    return "dtype" if isinstance(getattr(type(config), "torch_dtype", None), property) else "torch_dtype"


def save_hf(weights: nn.Module | Mapping[str, torch.Tensor], out: str | Path, model_config: Any = None,
            spec: ModelSpec | None = None, attributes: Mapping[str, Any] | None = None) -> Path:
    """Write ``weights`` (a model, or a full state dict with ``model_config``) to ``out`` as ``config.json`` and
    ``model.safetensors`` of ``spec``'s HF architecture, ``attributes`` (special token ids) in the config;
    returns ``out``. Tokenizer and generation config: :func:`trainmesh.checkpoint.export_hf`."""
    if isinstance(weights, nn.Module):
        model_config, weights = weights.cfg if model_config is None else model_config, weights.state_dict()
    spec = spec or spec_of_config(model_config)
    if spec.hf is None:
        raise HFError(f"trainmesh's {spec.family} has no Hugging Face architecture to be written as")
    try:
        attributes, converted = {**spec.hf.to_config(model_config), **(attributes or {})}, \
            spec.hf.to_hf(model_config, weights)
    except HFIncompatible as e:
        raise HFError(str(e)) from None
    config = _transformers().AutoConfig.for_model(spec.hf.model_type, architectures=[spec.hf.architecture],
                                                  **attributes)
    tensors = {k: v.detach().to("cpu").clone() for k, v in converted.items()}
    setattr(config, _dtype_attribute(config), next(iter(tensors.values())).dtype)  # from_pretrained(dtype="auto")
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    replace_durably(directory / WEIGHTS, safetensors.torch.save(tensors, metadata={"format": "pt"}))
    replace_durably(directory / CONFIG, config.to_json_string().encode())
    return directory
