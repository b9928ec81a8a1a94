"""Loading a checkpoint written in any layout into this rank's part of a model and its optimizer: resharding
is the boxes this layout holds intersected with those the checkpoint's layout saved."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from torch import nn

from trainmesh.training.engine import Engine
from trainmesh.distributed.mesh import Mesh, world_from_env
from trainmesh.checkpoint.store import (MANIFEST, CheckpointDamaged, CheckpointError, CheckpointMismatch,
                                        CheckpointOfAnotherRun, TrainingProgress, all_gather_json, apply_rng,
                                        candidates, fill, local_state, notice, read_manifest, rng_state,
                                        verified_tensors)
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


def load_newest(model: nn.Module, engine: Engine, mesh: Mesh, root: Path, run_id: str = "",
                accept: Callable[[dict, Path], None] = lambda manifest, path: None) -> TrainingProgress:
    """Load the newest sound checkpoint ``root`` is or holds (``latest``, then older ``step-N``), of any layout,
    into this rank's part of ``model`` and ``engine``; returns its progress (a collective). A damaged one, one of
    another run than ``run_id`` or refused by ``accept`` (:class:`CheckpointError`) is skipped on every rank,
    rank 0 saying why; a :class:`CheckpointMismatch` is raised, since no older one would fit either."""
    start = time.perf_counter()
    paths = [root] if (root / MANIFEST).exists() else candidates(root)
    tried = []
    for i, path in enumerate(paths):
        try:
            manifest, error = read_manifest(path), None
            if run_id and manifest["run"]["id"] != run_id:
                raise CheckpointOfAnotherRun(f"checkpoint {path} belongs to run {manifest['run']['id']}, not to "
                                             f"run {run_id} that is being resumed; it is not used")
            accept(manifest, path)
            load_state(model, engine, mesh, path, manifest)
        except CheckpointMismatch:
            raise
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = str(CheckpointDamaged(path, str(e)))
        errors = [e for e in all_gather_json(error, mesh.device) if e]
        if not errors:
            progress = apply_loaded(engine, manifest)
            notice(f"resumed from {path} (step {progress.step}) in {time.perf_counter() - start:.2f} s")
            return progress
        tried.append(errors[0])
        then = "falling back to the previous complete checkpoint" if i + 1 < len(paths) else "none is left to try"
        notice(f"{errors[0]}; {then}")
    of_run = f" of run {run_id}" if run_id else ""
    if tried:
        raise CheckpointError(f"no sound checkpoint{of_run} in {root}: " + "; ".join(tried))
    raise CheckpointError(f"{root} holds no checkpoint{of_run} (no step-N directory, no manifest.json)")


def apply_loaded(engine: Engine, manifest: dict) -> TrainingProgress:
    """The non-tensor state, and ZeRO stages 1-2's full parameters gathered from the loaded shards."""
    scaler = engine.scaler
    if scaler.enabled:
        for key, value in manifest["loss_scaler"].items():
            setattr(scaler, key, value)
    engine.after_update()
    return TrainingProgress(**manifest["progress"], run_id=manifest["run"]["id"])
