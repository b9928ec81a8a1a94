"""A checkpoint written in any layout, out as one plain safetensors file or as a Hugging Face model directory."""

from __future__ import annotations

import math
from pathlib import Path

import safetensors.torch

from trainmesh.checkpoint import hf_extras
from trainmesh.models import hf
from trainmesh.storage.safe_io import replace_durably
from trainmesh.checkpoint.store import (MANIFEST, CheckpointError, read_manifest, candidates, read_tensors)
from trainmesh.checkpoint.source import (family_weights, recorded_model, recorded_weights, source_name)


def _step_to_export(source: Path) -> Path:
    """``source`` if it is a ``step-N`` directory, else the checkpoint its ``latest`` names (or its newest)."""
    return source if (source / MANIFEST).exists() else next(iter(candidates(source)), source)


def export(source: Path, out: Path) -> str:
    """Write the weights of checkpoint ``source`` (a ``step-N`` directory, or a checkpoint directory: the
    one its ``latest`` names) to ``out`` as one plain safetensors file under the plain model's names."""
    path = _step_to_export(source)
    manifest = read_manifest(path)
    tensors = {name.removeprefix("model/"): t for name, t in read_tensors(path, "model/").items()}
    if manifest.get("model_source", {}).get("family") != "":  # a model of no family: nothing to check against
        family_weights(path, manifest, tensors)
    replace_durably(out, safetensors.torch.save(tensors, metadata={"format": "pt", "step": str(manifest["step"]),
                                                                   "model": source_name(manifest)}))
    n_params = sum(t.numel() for t in tensors.values())
    return f"wrote {len(tensors)} tensors ({n_params:,} parameters, step {manifest['step']}) of {path} to {out}"


def export_hf(source: Path, out: Path, overwrite: bool = False) -> str:
    """Write checkpoint ``source``'s weights to ``out`` as the family's Hugging Face model, with the run's
    tokenizer, special token ids and generation config, so ``from_pretrained(out)`` loads it. Files the export
    would write that already exist are refused before anything is written, or replaced with ``overwrite``."""
    path = _step_to_export(source)
    manifest = read_manifest(path)
    spec, model_config = recorded_model(manifest, path)
    tensors = recorded_weights(path, manifest)  # a routing bias moved in training is refused by the mapping
    extras = hf_extras.plan(manifest, path)
    files = hf_extras.contents(extras, model_config.vocab_size)
    clashes = hf_extras.clashes(out, [hf.CONFIG, hf.WEIGHTS, hf.INDEX, *files])
    if clashes and not overwrite:
        raise CheckpointError(f"export --hf {out} already holds {', '.join(clashes)}, which the export writes; "
                              f"choose an empty or new directory, or pass --overwrite to replace them")
    for name in clashes:
        (out / name).unlink()
    try:
        hf.save_hf(tensors, out, model_config, spec, attributes=extras.token_ids)
    except hf.HFError as e:
        raise CheckpointError(f"export --hf: {e}") from None
    written = hf_extras.write(files, out)
    notes = "".join(f"; {note}" for note in extras.notes)
    replaced = f"; replaced {', '.join(clashes)} (--overwrite)" if clashes else ""
    n_params = sum(math.prod(entry["shape"]) for name, entry in manifest["tensors"].items()
                   if name.startswith("model/"))  # not the routing biases, which are no parameters
    return (f"wrote {spec.hf.architecture} ({n_params:,} parameters, step "
            f"{manifest['step']}) of {path} to {out}, with {', '.join(written)}{replaced}{notes}")
