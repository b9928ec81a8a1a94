"""What a checkpoint records of its model, and the model read back from it: the family, its config in
trainmesh's terms and where it came from, so every command builds the model a checkpoint holds without a
preset name; a model a script held in Hugging Face's classes is read back under its family's names."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainmesh.models import hf
from trainmesh.models import any_config, config_from_dict, family, preset, spec_for, spec_of
from trainmesh.models.spec import HFIncompatible, ModelSpec
from trainmesh.checkpoint.store import (MANIFEST, CheckpointDamaged, CheckpointError, CheckpointMismatch, read_tensors,
                                        whole_pieces)


def describe_model(model: nn.Module) -> tuple[dict, dict]:
    """What a manifest records of a model a script parallelized (:func:`trainmesh.save`): its config in its
    trainmesh family's terms (what ``trainmesh train --resume``, ``generate`` and ``export`` build) and its
    source: the family and how to name the model. A model held in Hugging Face's classes also records its
    HF config, since its tensors carry HF's names; a model of no family records neither."""
    spec = spec_for(model)
    if spec is None:
        return {}, {"family": "", "source": type(model).__name__}
    cfg = spec.config_of(model)
    if not callable(getattr(cfg, "to_dict", None)):  # a trainmesh family's own config
        return dataclasses.asdict(cfg), {"family": spec.family, "source": f"{type(model).__name__} ({spec.family})"}
    hf_config = json.loads(json.dumps(cfg.to_dict(), default=str))
    source = (hf_config.get("architectures") or [type(model).__name__])[0]
    origin = hf_config.get("_name_or_path")
    source += f" from {origin}" if origin else ""
    try:
        family = hf.family_of(hf_config)
        ours = dataclasses.asdict(family.hf.from_config(hf_config))
    except (hf.HFError, HFIncompatible):
        return {}, {"family": "", "source": source, "hf_config": hf_config}
    return ours, {"family": family.family, "source": source, "hf_config": hf_config}


def recorded_model(manifest: dict, path: Path) -> tuple[ModelSpec, Any]:
    """The trainmesh family and model config a checkpoint describes (older checkpoints name a preset)."""
    source = manifest.get("model_source")
    if source is None:
        name = manifest["config"].get("model")
        return spec_of(name), config_from_dict(preset(name), manifest["model"])
    if not source["family"]:
        raise CheckpointError(f"{path} holds a {source['source']}, which is of no trainmesh model family; load it "
                              f"with trainmesh.load into the same model")
    spec = family(source["family"])
    return spec, config_from_dict(any_config(spec), manifest["model"])


def recorded_weights(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The full weights (and routing buffers, under ``buffer/`` names' tails) of checkpoint ``path`` under
    the names of its trainmesh family's model, translated from Hugging Face's names where a script saved a
    model held in HF's classes."""
    tensors = {name.split("/", 1)[1]: t for prefix in ("model/", "buffer/")
               for name, t in read_tensors(path, prefix).items()}
    return family_weights(path, manifest, tensors)


def family_weights(path: Path, manifest: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors``, weights of checkpoint ``path`` under the names they were saved by, under its family's
    names; refused in one line if the model the manifest describes has a weight they lack (naming the first),
    so an export or a load never writes or runs an incomplete model."""
    spec, cfg = recorded_model(manifest, path)
    if "hf_config" in manifest.get("model_source", {}):
        try:
            tensors = hf.to_trainmesh(spec, cfg, tensors, str(path))
        except hf.HFError as e:
            raise CheckpointError(str(e)) from None
    missing = missing_weight(spec, cfg, tensors)
    if missing is not None:
        raise CheckpointDamaged(path, f"{path / MANIFEST} lists no tensor model/{missing}, a weight of its model "
                                      f"{source_name(manifest)}; an incomplete checkpoint is neither exported "
                                      f"nor loaded")
    return tensors


def missing_weight(spec: ModelSpec, cfg: Any, names: Collection[str]) -> str | None:
    """The first parameter of ``spec``'s model of ``cfg`` that ``names`` lacks (the model is built on the
    meta device, which allocates nothing)."""
    with torch.device("meta"):
        model = spec.builder(cfg, 0)
    return next((name for name, _ in model.named_parameters() if name not in names), None)


def source_name(manifest: dict) -> str:
    """How a checkpoint's model is named to a person."""
    return manifest.get("model_source", {}).get("source") or manifest["config"].get("model") or "model"


def holds_names_of(model: nn.Module, manifest: dict) -> bool:
    """Whether ``model``'s parameters are named as the checkpoint's (a model held in Hugging Face's classes
    loading a checkpoint of one, as a script does) rather than as its trainmesh family's."""
    return all(f"model/{name}" in manifest["tensors"] for name, _ in model.named_parameters())


def in_family_names(path: Path, manifest: dict) -> tuple[dict, Callable[[str], dict[str, torch.Tensor]]]:
    """The training state of a checkpoint a script saved from a model held in Hugging Face's classes, under
    its trainmesh family's names (``trainmesh train --resume`` builds that family's model): parameters and
    both Adam moments translated by the family's mapping alike (they are laid out as the parameters), step
    counters and generator states as they are. Read whole, in one piece per tensor, on each rank."""
    spec, cfg = recorded_model(manifest, path)
    full = read_tensors(path)
    params = [name.removeprefix("model/") for name in full if name.startswith("model/")]
    out = {k: t for k, t in full.items() if k.startswith(("rng/", "buffer/"))}
    for form in ("model/{}", "optim/{}/exp_avg", "optim/{}/exp_avg_sq"):
        tensors = {name: full[form.format(name)] for name in params}
        try:
            renamed = hf.to_trainmesh(spec, cfg, tensors, str(path))
        except hf.HFError as e:
            raise CheckpointMismatch(str(e)) from None
        out.update({form.format(name): t for name, t in renamed.items()})
    step = full[f"optim/{params[0]}/step"]
    out.update({f"optim/{name}/step": step for name in renamed})
    return whole_pieces(out, "translated"), lambda _: out
