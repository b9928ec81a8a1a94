"""Hugging Face checkpoints in and out: a local ``transformers`` model directory read into a trainmesh model
family, and a trainmesh model written as one that ``AutoModelForCausalLM.from_pretrained`` loads.

What differs between the two is data in each family's spec (:class:`trainmesh.models.spec.HFMapping`: the
architecture, the config translation both ways, the tensor renames and re-layouts); this module only reads
and writes directories and dispatches through the spec. Three rules:

* no pickle is ever loaded: weights are read from ``model.safetensors`` (or the shards a
  ``model.safetensors.index.json`` lists); a directory holding only ``pytorch_model.bin`` is refused;
* nothing is downloaded: a path that does not exist (a hub id such as ``meta-llama/Llama-3-8B``) is an
  error asking for a local copy, and transformers reads configs with ``local_files_only``;
* config files are read and written by transformers' own config classes (which fill in every default a
  ``config.json`` leaves out), tensors by safetensors. transformers is imported only here and only when
  a config is read or written, so trainmesh itself imports and trains without it (the ``hf`` extra).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from trainmesh.models import SPECS, is_moe
from trainmesh.models.spec import HFIncompatible, ModelSpec
from trainmesh.safe_io import replace_durably

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


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


def family_of(hf_config: Mapping[str, Any], where: str = "config.json") -> ModelSpec:
    """The family whose architecture ``hf_config`` names (``model_type``, else ``architectures``)."""
    architectures = hf_config.get("architectures") or []
    for spec in SPECS:
        if spec.hf and (hf_config.get("model_type") == spec.hf.model_type or spec.hf.architecture in architectures):
            return spec
    known = ", ".join(f"{s.hf.architecture} ({s.hf.model_type})" for s in SPECS if s.hf)
    found = hf_config.get("model_type") or architectures or "no model_type"
    raise HFError(f"{where} describes {found}; trainmesh imports {known}")


@functools.lru_cache(maxsize=8)
def _read_config(directory: Path) -> tuple[ModelSpec, Any]:
    transformers = _transformers()
    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError) as e:
        raise HFError(f"{directory / CONFIG} cannot be read by transformers: {' '.join(str(e).split())}") from None
    spec = family_of(hf_config, str(directory / CONFIG))
    try:
        cfg = spec.hf.from_config(hf_config)
        spec.shape(cfg)
    except (HFIncompatible, ValueError) as e:
        raise HFError(f"{directory / CONFIG}: {e}") from None
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
    """A file's tensors as meta tensors: names, shapes and dtypes from the header, no data read."""
    with safetensors.safe_open(file, framework="pt") as f:
        return {name: torch.empty(f.get_slice(name).get_shape(), device="meta") for name in f.keys()}


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
    return ours


def check_weights(path: str | Path) -> tuple[ModelSpec, Any]:
    """Before any rank starts: the config is readable and the weight files' headers hold exactly the
    tensors the mapping needs (no tensor data is read)."""
    spec, cfg = read_config(path)
    directory = hf_dir(path)
    to_trainmesh(spec, cfg, _read_files(directory, _meta_tensors), str(directory))
    return spec, cfg


def read_hf(path: str | Path) -> tuple[ModelSpec, Any, dict[str, torch.Tensor]]:
    """The family, model config and full weights (under our names) of HF directory ``path``."""
    spec, cfg = read_config(path)
    directory = hf_dir(path)
    return spec, cfg, to_trainmesh(spec, cfg, _read_files(directory, safetensors.torch.load_file), str(directory))


@torch.no_grad()
def load_hf(model: nn.Module, path: str | Path) -> nn.Module:
    """Load the weights of HF directory ``path`` into ``model``, a trainmesh model of the directory's family
    and shape (``models.spec_of(...).builder(read_config(path)[1])``), before it is parallelized, or a
    pipeline stage of one (it takes the tensors it holds). The training path (``trainmesh train
    --init-hf``) reshards them onto any layout itself. Returns ``model``."""
    spec, _, weights = read_hf(path)
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


def save_hf(weights: nn.Module | Mapping[str, torch.Tensor], out: str | Path, model_config: Any = None,
            spec: ModelSpec | None = None, attributes: Mapping[str, Any] | None = None) -> Path:
    """Write ``weights`` (a trainmesh model, or its full state dict with ``model_config``) to directory ``out``
    (created with its parents) as ``config.json`` and ``model.safetensors`` of the HF architecture of
    ``spec``'s family (default: the family of ``model_config``), with ``attributes`` (the special token ids)
    set in the config; returns ``out``. The tokenizer and generation config are the checkpoint's to give
    (:func:`trainmesh.checkpoint.export_hf`)."""
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
    config.torch_dtype = next(iter(tensors.values())).dtype  # from_pretrained(dtype="auto") keeps it
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    replace_durably(directory / WEIGHTS, safetensors.torch.save(tensors, metadata={"format": "pt"}))
    replace_durably(directory / CONFIG, config.to_json_string().encode())
    return directory
