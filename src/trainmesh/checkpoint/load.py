"""Loading a checkpoint written in any layout into this rank's part of a model and its optimizer: resharding
is the boxes this layout holds intersected with those the checkpoint's layout saved."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from trainmesh.training.engine import Engine
from trainmesh.distributed.mesh import Mesh, world_from_env
from trainmesh.checkpoint.store import (MANIFEST, CheckpointDamaged, TrainingProgress, local_state, rng_state, on_every_rank, read_manifest, verified_tensors, fill, apply_rng)
from trainmesh.checkpoint.source import (holds_names_of, in_family_names)


def load_state(model: nn.Module, engine: Engine, mesh: Mesh, path: Path, manifest: dict) -> None:
    """Read checkpoint ``path`` (whose sound ``manifest`` is given) into this rank's part of ``model`` and
    ``engine``'s optimizer, in their own layout (no collective): resharding is the boxes this layout holds
    intersected with those the checkpoint's layout saved. Generator states are restored in the same world."""
    rank, device = world_from_env()[0], mesh.device
    same_world = manifest["layout"]["world_size"] == mesh.world_size
    rng = rng_state(rank, device) if same_world else []
    index, open_file = manifest["tensors"], lambda name: verified_tensors(path, name, manifest["files"])
    if "hf_config" in manifest.get("model_source", {}) and not holds_names_of(model, manifest):
        index, open_file = in_family_names(path, manifest)
    try:
        fill(local_state(model, engine, listed=index) + rng, index, open_file, path,
             lambda what: CheckpointDamaged(path, f"{path / MANIFEST} lists the model this run has, but {what}"))
    except OSError as e:  # reading a file that passed every check failed (permissions, an I/O error)
        raise CheckpointDamaged(path, str(e)) from None
    apply_rng(rng, manifest, path, device)


def load_anywhere(model: nn.Module, engine: Engine, mesh: Mesh, path: Path) -> TrainingProgress:
    """Load checkpoint ``path``, written in any layout, into this rank's part of ``model`` and ``engine`` (a
    collective: a failure on any rank is raised on every rank); returns the progress it records."""
    manifest = read_manifest(path)
    on_every_rank(lambda: load_state(model, engine, mesh, path, manifest), mesh.device, f"loading {path}")
    return apply_loaded(engine, manifest)


def apply_loaded(engine: Engine, manifest: dict) -> TrainingProgress:
    """The non-tensor state, and ZeRO stages 1-2's full parameters gathered from the loaded shards."""
    scaler = engine.scaler
    if scaler.enabled:
        for key, value in manifest["loss_scaler"].items():
            setattr(scaler, key, value)
    engine.after_update()
    return TrainingProgress(**manifest["progress"], run_id=manifest["run"]["id"])
