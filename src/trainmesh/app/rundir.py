"""The directories a run writes (``--out`` and ``--checkpoint-dir``), checked before any rank starts:
created, probed with a file, and the checkpoint directory's free space compared with one checkpoint's
predicted size, rather than learning hours later that a save cannot be written."""

from __future__ import annotations

import os
import secrets
import shutil
from datetime import datetime
from pathlib import Path

from trainmesh.app.config import Config, ConfigError
from trainmesh.storage.safe_io import remove_entry
from trainmesh.tracking import runlock
from trainmesh.tracking.records import check_no_links, run_records
from trainmesh.training.state_bytes import precision_bytes

RUNS_ROOT = "runs"


def default_out_dir(root: str = RUNS_ROOT) -> str:
    """A new run directory ``runs/<timestamp>-<random>``, created here: ``mkdir`` failing on an existing name
    is what makes it unique (a collision draws again)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    Path(root).mkdir(parents=True, exist_ok=True)
    while True:
        path = Path(root) / f"{stamp}-{secrets.token_hex(3)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return str(path)


def _file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` (or ``path`` itself) that is not a directory."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def ensure_writable(path: Path, flag: str) -> None:
    """Create directory ``path`` if needed and prove that a file can be created and removed in it."""
    blocker = _file_above(path)
    if blocker is not None:
        where = "is a file" if blocker == path else f"lies under {blocker}, which is a file"
        raise ConfigError(f"{flag} {path} {where}, not a directory; choose a directory for {flag}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".trainmesh-probe-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag} {path} is not writable ({e.strerror or e}); choose a directory you can "
                          f"write to for {flag}") from None


def checkpoint_bytes(cfg: Config) -> int:
    """Predicted bytes of one checkpoint: every parameter once in its dtype, plus the optimizer state
    (Adam's two moments, and fp32 master weights in mixed precision: K = 8 bytes per parameter in fp32,
    16 in fp64, 12 in bf16/fp16 [ZeRO, 3.1]); a checkpoint holds each piece once whatever the layout."""
    b = precision_bytes(cfg.layout.precision, cfg.layout.grad_dtype)
    return cfg.model_config.n_params() * (b.param + b.optimizer)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def checkpoints_at_once(cfg: Config) -> int:
    """How many checkpoints the checkpoint directory holds at most during the run: ``--keep-last K`` kept and
    the one being written (the oldest goes only once it is complete), or every save with ``--keep-last 0``."""
    every = cfg.checkpoint.checkpoint_every
    saves = (cfg.optim.steps // every + bool(cfg.optim.steps % every)) if every > 0 else 1
    return min(saves, cfg.checkpoint.keep_last + 1) if cfg.checkpoint.keep_last else saves


def check_free_space(path: Path, checkpoints: int, each: int, flag: str) -> None:
    free, need = shutil.disk_usage(path).free, checkpoints * each
    if free < need:
        what = "one checkpoint needs" if checkpoints == 1 else (
            f"the {checkpoints} checkpoints it holds at once (--keep-last and the one being written) need")
        raise ConfigError(f"{flag} {path} has {_mib(free)} free but {what} about {_mib(need)}; free space there, "
                          f"keep fewer with --keep-last, or choose another {flag}")


def check_run_dirs(cfg: Config) -> None:
    """Before spawning: ``--out`` and ``--checkpoint-dir`` are writable directories, no file a run writes in
    ``--out`` is a symbolic link, and the checkpoint directory has room for the checkpoints it keeps."""
    if cfg.logging.out:
        ensure_writable(Path(cfg.logging.out), "--out")
        check_no_links(Path(cfg.logging.out), runlock.LOCK_NAME)
    if cfg.checkpoint.checkpoint_dir:
        ensure_writable(Path(cfg.checkpoint.checkpoint_dir), "--checkpoint-dir")
        check_free_space(Path(cfg.checkpoint.checkpoint_dir), checkpoints_at_once(cfg), checkpoint_bytes(cfg), "--checkpoint-dir")


def make_out_fresh(cfg: Config) -> None:
    """A fresh run (no ``--resume``) never overwrites the records of another run in ``--out`` (its metrics,
    summary, report, TensorBoard events): they are refused with the way out, or deleted with
    ``--overwrite``. Called while ``--out``'s lock is held, so a live run there is refused before this."""
    out = Path(cfg.logging.out)
    found = run_records(out) if cfg.logging.out and not cfg.checkpoint.resume else []
    if not found:
        return
    if not cfg.checkpoint.overwrite:
        names = ", ".join(p.name for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(f"--out {out} holds the records of another run ({names}); pass --overwrite to replace "
                          f"them, --resume to continue that run, or choose another --out")
    for path in found:
        remove_entry(path)
