"""What ``trainmesh train`` does with checkpoints: when to save, which run to resume, where a fresh run starts,
the lock on ``--checkpoint-dir``, and the model ``--resume`` takes from the checkpoint it continues.

Every run has an id its manifests record; the launching process holds ``D/trainmesh.lock`` noting it
(:func:`claim`), so a second live run is refused while the ranks' saves go ahead. Details: docs/checkpoints.md."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from trainmesh import api
from trainmesh.models import hf
from trainmesh.app.config import Config
from trainmesh.data import pin_tokenizer
from trainmesh.data.chat import template_dir
from trainmesh.data.tokenizer import TOKENIZER_FILE, TokenizerError, TokenizerFile
from trainmesh.checkpoint.manifest import RUN_ID, show
from trainmesh.distributed.mesh import world_from_env
from trainmesh.models import register_preset, spec_of
from trainmesh.models.weights import first_untrainable, scan_file
from trainmesh.tracking import runlock
from trainmesh.storage.safe_io import fsync_dir
from trainmesh.checkpoint.store import (LATEST, LEFTOVER, LOCK, RUN_ID_ENV, STEP_DIR, CheckpointError, CheckpointMismatch,
                                        TrainingProgress, agreed_run_id, candidates, fill, local_state, notice,
                                        on_every_rank, parse_manifest, read_manifest, routing_state, whole_pieces)
from trainmesh.checkpoint.async_save import AsyncSave
from trainmesh.checkpoint import memory
from trainmesh.checkpoint.source import recorded_model, source_name

if TYPE_CHECKING:
    from trainmesh.app.run import Run


def model_source(cfg: Config) -> str:
    """How runs, summaries and reports name the model of a ``trainmesh train`` run: its preset, or for an
    ``--init-hf`` import the architecture and the directory it came from (``LlamaForCausalLM from DIR``)."""
    if not cfg.checkpoint.init_hf:
        return cfg.model.model
    architecture = spec_of(cfg.model.model).hf.architecture
    return f"{architecture} from {cfg.checkpoint.init_hf}"


def save(run: Run, progress: TrainingProgress, async_: bool = False) -> Path | AsyncSave:
    """Save the training state after ``progress.step`` steps under ``--checkpoint-dir`` (a collective) through
    :func:`trainmesh.api.save`, with the run's settings, its ``--keep-last`` and its ``--init-hf`` source (else chat
    data's tokenizer files, its chat template among them: :func:`~trainmesh.data.chat.template_dir`), and a
    copy of the tokenizer the run started with; a tokenizer file changed or deleted since is said, and the
    checkpoint still keeps the one the run trained with. ``async_``: in the background (``--checkpoint-async``)."""
    if run.tokenizer is not None and world_from_env()[0] == 0:
        notice_changed_tokenizer(run.tokenizer)
    cfg = run.cfg
    return api.save(run.parallel, run.opt, cfg.checkpoint.checkpoint_dir, progress, run.tokenizer, cfg.checkpoint.keep_last, async_=async_,
                    config=cfg.settings(), hf_source=cfg.checkpoint.init_hf or template_dir(cfg.data.data))


def notice_changed_tokenizer(pinned: TokenizerFile) -> None:
    try:
        now = TokenizerFile.read(pinned.source).sha256
    except TokenizerError:
        now = "missing"
    if now != pinned.sha256:
        notice(f"tokenizer {pinned.source} is {'missing' if now == 'missing' else f'now SHA-256 {now[:12]}'}, "
               f"not the {pinned.sha256[:12]} this run started with; the checkpoint keeps a copy of the one it "
               f"trained with")


def check_tokenizer(manifest: dict, path: Path, pinned: TokenizerFile | None) -> None:
    """Refuse (:class:`CheckpointMismatch`, one line naming both tokenizers and the first 12 hex digits of
    their SHA-256) a checkpoint trained with another tokenizer than this run's: a different one of the same
    (padded) vocabulary size would be accepted by every shape and read every id as another token."""
    record = manifest.get("tokenizer", {"kind": "bytes"})
    there = None if record["kind"] == "bytes" else record["sha256"]
    if there == (pinned.sha256 if pinned else None):
        return
    theirs = "byte tokens" if there is None else (
        f"tokenizer {record.get('source') or record.get('path')} (SHA-256 {there[:12]})")
    ours = "byte tokens" if pinned is None else f"tokenizer {pinned.short()}"
    copy = f" (the checkpoint keeps a copy: --tokenizer {path / TOKENIZER_FILE})" if record["kind"] == "copy" else ""
    raise CheckpointMismatch(f"checkpoint {path} was trained with {theirs}, and this run has {ours}; pass the "
                             f"tokenizer it was trained with{copy}")


def due(cfg: Config, steps_done: int) -> bool:
    """Whether to save after ``steps_done`` steps: every ``--checkpoint-every`` steps and at the end."""
    every = cfg.checkpoint.checkpoint_every
    return bool(cfg.checkpoint.checkpoint_dir) and ((every > 0 and steps_done % every == 0) or steps_done == cfg.optim.steps)


def _check_model(manifest: dict, cfg: Config, path: Path) -> None:
    there, name = manifest["model"], source_name(manifest)
    differ = [f"{k} {there.get(k)} there, {v} here" for k, v in dataclasses.asdict(cfg.model_config).items()
              if there.get(k) != v]
    if len(differ) == 1 and differ[0].startswith("vocab_size "):
        raise CheckpointMismatch(f"{path} holds a model with vocabulary {there.get('vocab_size')}, and this run's "
                                 f"tokenizer/data gives {cfg.model_config.vocab_size} (padded for tp={cfg.layout.tp}); "
                                 f"pass the tokenizer and data the checkpoint was trained with "
                                 f"(--tokenizer {manifest['config'].get('tokenizer') or '(bytes)'})")
    if differ:
        raise CheckpointMismatch(f"{path} holds a different model ({name}: {', '.join(differ)}); "
                                 f"resume without --model/--init-hf to continue it, or choose another "
                                 f"--checkpoint-dir to start afresh")


def check_fits(run: Run, manifest: dict, path: Path) -> None:
    """Refuse (:class:`CheckpointMismatch`) checkpoint ``path`` (its sound ``manifest``) if it holds another
    model or was trained with another tokenizer than ``run``'s."""
    _check_model(manifest, run.cfg, path)
    check_tokenizer(manifest, path, run.tokenizer)


def run_to_continue(root: Path) -> str | None:
    """The run that ``--resume`` continues in ``root``: the one that last claimed it (its lock file says),
    else the one of the newest checkpoint whose manifest is sound (its shards may be damaged: the run is
    still the one that wrote it); None if there is none."""
    owner = runlock.read_record(root / LOCK).get("run_id")
    if isinstance(owner, str) and RUN_ID.fullmatch(owner):
        return owner
    for path in candidates(root):
        try:
            return parse_manifest(path)["run"]["id"]
        except CheckpointError:
            continue
    return None


def resume(run: Run) -> TrainingProgress | None:
    """Load the newest sound checkpoint of this run under ``--checkpoint-dir`` through :func:`trainmesh.api.load`
    (which skips damaged ones); None if there is none (a collective). The run is the one ``TRAINMESH_RUN_ID``
    names (set by :func:`claim`), else :func:`run_to_continue`'s. A checkpoint of another model is an error
    (:func:`check_fits`), not a reason to go back further."""
    root = Path(run.cfg.checkpoint.checkpoint_dir)
    if not candidates(root):
        notice(f"no checkpoint in {root} yet; starting at step 0")
        return None
    loaded = []
    api.load(run.parallel, run.opt, root, run_id=os.environ.get(RUN_ID_ENV) or run_to_continue(root) or "",
             accept=lambda manifest, path: check_fits(run, manifest, path) or loaded.append(manifest))
    return TrainingProgress(**loaded[-1]["progress"], run_id=loaded[-1]["run"]["id"])


def load_weights(run: Run, path: Path) -> None:
    """Start from the weights of a plain (unsharded) safetensors model file; every rank reads from it the
    parts it holds, so it works in any layout. The optimizer starts afresh."""
    try:
        full = safetensors.torch.load_file(path)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"--init-from {path}: not a readable safetensors file ({e}); write one with "
                              f"'trainmesh export CKPT --to FILE'") from None
    if problem := first_untrainable(full.items()):
        raise CheckpointError(f"--init-from {path}: {problem}")
    load_full(run, full, f"--init-from {path}")


def load_hf_weights(run: Run, path: Path) -> None:
    """Start from the weights of a local Hugging Face directory (``--init-hf``), converted to our names by
    the family's mapping (:mod:`trainmesh.models.hf`) and resharded like ``--init-from``'s."""
    try:
        full = hf.read_hf(path)[2]
    except hf.HFError as e:
        raise CheckpointError(f"--init-hf: {e}") from None
    load_full(run, full, f"--init-hf {path}")


def load_full(run: Run, full: dict[str, torch.Tensor], source: str) -> None:
    """Copy into this rank's part of ``run`` (in any layout) the parts it holds of the full weights ``full``,
    under the plain model's names, and the routing biases ``full`` carries (DeepSeek-V3's, not parameters);
    ``source`` names where they came from in errors."""
    model = f"the model of {run.cfg.checkpoint.init_hf}/config.json" if run.cfg.checkpoint.init_hf else f"--model {run.cfg.model.model}"
    with torch.device("meta"):
        buffers = {name for name, _ in spec_of(run.cfg.model.model).builder(run.cfg.model_config, 0).named_buffers()}
    weights = {k: t for k, t in full.items() if k not in buffers}
    wanted = [t for t in local_state(run.model, run.engine) if t.name.startswith("model/")]
    missing = next((t.name.removeprefix("model/") for t in wanted if t.name.removeprefix("model/") not in full), None)
    if missing is not None:
        raise CheckpointMismatch(f"{source} lacks {missing}, a weight of {model}; use complete weights of this "
                                 f"model")
    n_params = sum(t.numel() for t in weights.values())
    if n_params != run.cfg.model_config.n_params():
        raise CheckpointMismatch(f"{source} holds {n_params:,} parameters, {model} has "
                                 f"{run.cfg.model_config.n_params():,}; use weights of this model")
    index = {**whole_pieces(weights, "weights", prefix="model/"),
             **whole_pieces({k: t for k, t in full.items() if k in buffers}, "weights", prefix="buffer/")}
    routing = [t for t in routing_state(run.model, listed=index) if t.name in index]
    fill(wanted + routing, index, lambda _: full, Path(source),
         lambda what: CheckpointMismatch(f"{source} holds a different model: {what}; use weights of {model}"))
    run.engine.after_update()


def start_fresh(cfg: Config) -> None:
    """Make ``--checkpoint-dir`` ready for a fresh run: a directory holding checkpoints (of another run) is
    refused, or with ``--overwrite`` emptied of them first (step directories, leftovers of interrupted
    saves and the ``latest`` pointer), so no step of the other run survives to be resumed or fallen back to."""
    root = Path(cfg.checkpoint.checkpoint_dir)
    existing = candidates(root)
    if not existing:
        return
    if not cfg.checkpoint.overwrite:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise CheckpointError(f"{root} holds checkpoints of another run ({existing[0].name}{more}, run "
                              f"{run_to_continue(root) or 'unknown'}); pass --resume to continue that run, "
                              f"--overwrite to delete them and start afresh, or choose another --checkpoint-dir")
    for p in root.iterdir():
        if STEP_DIR.fullmatch(p.name) or LEFTOVER.fullmatch(p.name):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    (root / LATEST).unlink(missing_ok=True)
    fsync_dir(root)


def snapshots(run: Run) -> memory.MemorySnapshots | None:
    """``--memory-snapshot``'s keeper for this run (a collective: the run's id is agreed), else None."""
    every = {"off": None, "auto": 0, "every-step": 1}[run.cfg.checkpoint.memory_snapshot]
    return None if every is None else memory.MemorySnapshots(run.mesh, agreed_run_id(run.mesh.device), every)


def _newest_disk_step(root: Path) -> int:
    for path in candidates(root):
        try:
            return parse_manifest(path)["progress"]["step"]
        except CheckpointError:
            continue
    return -1


def resume_from_memory(run: Run, keeper: memory.MemorySnapshots) -> TrainingProgress | None:
    """Load the run's newest complete memory snapshot, unless a disk checkpoint is newer; None where none is
    (:func:`trainmesh.checkpoint.memory.restore` says so if some are left), for :func:`resume` to load from disk."""
    start = time.perf_counter()
    progress = memory.restore(run.model, run.engine, run.mesh, keeper.run_id, keeper.root, keeper.group)
    if progress is None:
        return None
    root = Path(run.cfg.checkpoint.checkpoint_dir) if run.cfg.checkpoint.checkpoint_dir else None
    if root is not None and _newest_disk_step(root) > progress.step:
        return None
    notice(f"resumed from memory snapshots (step {progress.step}) in {time.perf_counter() - start:.2f} s")
    return progress


def restore(run: Run, keeper: memory.MemorySnapshots | None = None) -> TrainingProgress:
    """Where training starts: with ``--resume``, the run's memory snapshots (``keeper``'s, if kept and newest)
    or its latest checkpoint (if there is one), else the weights of ``--init-from``, else step 0 as built; a
    fresh run first makes ``--checkpoint-dir`` its own (:func:`start_fresh`). The progress returned carries
    the run's id, which every save records."""
    cfg, device = run.cfg, run.mesh.device
    progress = resume_from_memory(run, keeper) if cfg.checkpoint.resume and keeper is not None else None
    if progress is None and cfg.checkpoint.resume:
        progress = resume(run)
    if progress is not None and progress.step >= cfg.optim.steps:
        raise CheckpointError(f"the checkpoint in {cfg.checkpoint.checkpoint_dir} is at step {progress.step}, which --steps "
                              f"{cfg.optim.steps} has reached; pass a larger --steps to train further")
    if progress is not None:
        return progress
    if cfg.checkpoint.checkpoint_dir and not cfg.checkpoint.resume:
        rank = world_from_env()[0]
        on_every_rank(lambda: start_fresh(cfg) if rank == 0 else None, device,
                       f"starting a fresh run in {cfg.checkpoint.checkpoint_dir}")
    if cfg.checkpoint.init_from:
        load_weights(run, Path(cfg.checkpoint.init_from))
    if cfg.checkpoint.init_hf:
        load_hf_weights(run, Path(cfg.checkpoint.init_hf))
    return TrainingProgress(run_id=agreed_run_id(device))


@contextlib.contextmanager
def claim(cfg: Config) -> Iterator[str]:
    """Hold ``--checkpoint-dir`` for the life of this run (``trainmesh.lock`` in it, by the process that
    launches the ranks) and decide the run's id: the id of the run ``--resume`` continues, else a new one
    for a fresh run (after :func:`start_fresh`). The ranks this process starts inherit the id in
    ``TRAINMESH_RUN_ID``. A directory that another live run holds is an error naming that run's pid."""
    if not cfg.checkpoint.checkpoint_dir:
        yield ""
        return
    root = Path(cfg.checkpoint.checkpoint_dir)
    with contextlib.ExitStack() as held:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = held.enter_context(runlock.hold(root, "--checkpoint-dir", LOCK, keep=True))
        except runlock.DirectoryInUse as e:
            raise CheckpointError(f"{root} is in use by another live run (pid {show(e.holder.get('pid'))}, run "
                                  f"{show(e.holder.get('run_id'))}); wait for it to end, stop it, or choose "
                                  f"another --checkpoint-dir") from None
        except OSError as e:
            raise CheckpointError(f"--checkpoint-dir {root} cannot be used: {e}") from None
        held.callback(os.environ.pop, RUN_ID_ENV, None)
        run_id = run_to_continue(root) if cfg.checkpoint.resume else None
        if run_id is None:
            if not cfg.checkpoint.resume:
                start_fresh(cfg)
            run_id = uuid.uuid4().hex
        lock.note(run_id=run_id)
        os.environ[RUN_ID_ENV] = run_id
        yield run_id


MODEL_SETTINGS = ("tokenizer", "moe_experts", "moe_top_k", "moe_dense_layers", "moe_dropless", "moe_capacity",
                  "moe_aux_coef", "moe_z_coef", "moe_bias_rate")
"""The settings besides ``model`` that shape a ``trainmesh train`` run's model."""


def model_settings(root: Path, given: Collection[str]) -> dict[str, Any]:
    """What ``--resume`` without ``--model``/``--init-hf`` takes from the newest sound checkpoint in ``root``: its
    model (a preset's name, or one registered under its source, e.g. ``LlamaForCausalLM from DIR``) and the
    recorded settings that shaped it, except those in ``given``. Empty without one."""
    for path in candidates(root):
        try:
            manifest = read_manifest(path)
            spec, cfg = recorded_model(manifest, path)
        except CheckpointError:
            continue
        name = source_name(manifest)
        if name not in {**spec.presets, **spec.planner_presets}:
            # no preset builds it (an --init-hf import, a script's model); a preset's run is rebuilt from the
            # preset and the settings below (a tokenizer pads the vocabulary), held to the manifest on restore
            register_preset(spec, name, cfg)
        recorded = manifest["config"]
        settings = {k: recorded[k] for k in MODEL_SETTINGS if k in recorded and k not in given}
        return {**settings, "model": name, "init_hf": "", **({} if "seq_len" in given else {"seq_len": 0})}
    return {}


def _check_trainable(path: Path) -> None:
    """``--init-from``'s file before any rank starts: floating-point, finite weights (read one at a time)."""
    try:
        problem = scan_file(path)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"--init-from {path}: not a readable safetensors file ({e}); write one with "
                              f"'trainmesh export CKPT --to FILE'") from None
    if problem:
        raise CheckpointError(f"--init-from {path}: {problem}")


def check_resumable(cfg: Config) -> None:
    """Before spawning: a checkpoint of another model (or a missing ``--init-from``, an ``--init-hf``
    directory whose weights do not fit its config) is a one-line error."""
    if cfg.checkpoint.init_from and not Path(cfg.checkpoint.init_from).is_file():
        raise CheckpointError(f"--init-from {cfg.checkpoint.init_from} does not exist")
    if cfg.checkpoint.init_from:
        _check_trainable(Path(cfg.checkpoint.init_from))
    if cfg.checkpoint.init_hf:
        try:
            hf.check_weights(cfg.checkpoint.init_hf)
        except hf.HFError as e:
            raise CheckpointError(f"--init-hf: {e}") from None
    if not cfg.checkpoint.resume:
        return
    for path in candidates(Path(cfg.checkpoint.checkpoint_dir)):
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        _check_model(manifest, cfg, path)
        check_tokenizer(manifest, path, pin_tokenizer(cfg.data.data, cfg.data.tokenizer))
        return
