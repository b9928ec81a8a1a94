"""Checkpoints that do not stall training: stage to host memory, write in the background, publish when durable.

As torchtitan's and Megatron's async saves: the training thread copies each rank's state to host buffers
(the stall); a writer thread writes the synchronous save's files byte for byte, and rank 0 publishes only
once every rank's marker says its file is durable. Markers go through the directory, not a collective,
which would race the training thread's. At most one save is in flight. Details: docs/checkpoints.md."""

from __future__ import annotations

import copy
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch import nn

from trainmesh.checkpoint import store
from trainmesh.training.engine import Engine
from trainmesh.distributed.mesh import Mesh
from trainmesh.storage.safe_io import write_durably

MARKER = ".written-rank-{rank:05d}.json"
POLL_S = 0.01


class OtherRankFailed(store.CheckpointError):
    """Rank 0 stopped waiting because another rank posted its failure; that rank reports it itself."""


class AsyncSave:
    """A checkpoint being written in the background. ``stall_s``: what the training thread spent staging;
    ``write_s``: the background write (on rank 0, until published). :meth:`wait` before relying on it."""

    def __init__(self, path: Path, mesh: Mesh, stall_s: float, work: Callable[[float], None], timeout_s: float,
                 host: store.HostBuffers) -> None:
        self.path, self.mesh, self.stall_s, self.timeout_s, self.host = path, mesh, stall_s, timeout_s, host
        self.write_s: float | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"trainmesh-save-{path.name}")
        self._thread.start()

    def _run(self, work: Callable[[float], None]) -> None:
        start = time.perf_counter()
        try:
            work(self.timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported on every rank by wait()
            self._error = e
        self.write_s = time.perf_counter() - start

    def done(self) -> bool:
        """Whether this rank's part (and on rank 0 the publishing) has finished, without waiting."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Wait for the write, then (a collective) raise on every rank if it failed on any; the step directory."""
        if not self._finished:
            self._thread.join()
            self._finished = True
            error = None if isinstance(self._error, OtherRankFailed) else self._error
            try:
                store.on_every_rank(lambda: _reraise(error), self.mesh.device, f"writing {self.path} in the background")
            except store.CheckpointError as e:
                previous = next((p.name for p in store.candidates(self.path.parent)), None)
                raise store.CheckpointError(f"saving checkpoint {self.path} failed: {e}; the previous checkpoint "
                                            f"({previous or 'none'}) is untouched and --resume will use it; free "
                                            f"space in {self.path.parent} or choose another --checkpoint-dir") from e
        return self.path


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def save_state_async(model: nn.Module, engine: Engine, mesh: Mesh, root: Path, progress: store.TrainingProgress,
                     description: dict, previous: AsyncSave | None = None, keep_last: int = 0) -> AsyncSave:
    """:func:`store.save_state`, returning once this rank's state is in host memory (a collective); the files
    are written by a background thread, which on rank 0 also prunes to ``keep_last`` once the checkpoint is
    published. ``previous`` (the save before, if any) is waited for first."""
    if previous is not None:
        previous.wait()
    host = previous.host if previous is not None else store.HostBuffers()
    start = time.perf_counter()
    staged = store.stage(model, engine, mesh, root, progress, host)
    rank, final, tmp, ours = staged.rank, staged.final, staged.tmp, staged.ours
    failed_key = store.on_every_rank(lambda: _begin(tmp) if rank == 0 else None, staged.device, f"creating {tmp}")[0]
    scaler, world = copy.copy(engine.scaler), len(staged.plans)

    def write(timeout_s: float) -> None:
        try:
            record = store._write_rank_file(tmp / f"rank-{rank:05d}.safetensors", ours)
            write_durably(tmp / MARKER.format(rank=rank), json.dumps(record).encode())
        except Exception as e:
            if world > 1:
                dist.distributed_c10d._get_default_store().set(failed_key, f"rank {rank}: {type(e).__name__}: {e}")
            raise
        if rank == 0:
            files = _wait_for_every_rank(tmp, world, timeout_s, failed_key)  # other ranks may still be writing
            try:
                store._publish(tmp, final, store._manifest(description, scaler, staged.progress, staged.plans,
                                                                    staged.writers, files), description)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            store.prune(final, keep_last)

    return AsyncSave(final, mesh, time.perf_counter() - start, write, mesh.timeout_s or 600.0, host)


def _begin(tmp: Path) -> str:
    """Make the empty staging directory ``tmp``; the store key, new for this save, a failing rank posts to."""
    store._fresh_dir(tmp)
    return f"trainmesh/save-failed/{uuid.uuid4().hex}"


def _wait_for_every_rank(tmp: Path, world: int, timeout_s: float, failed_key: str) -> list[dict]:
    """Every rank's file record, once each has left its marker (within ``timeout_s``; a failure a rank posts
    under ``failed_key`` ends the wait at once); the markers are then removed, so the directory holds what a
    synchronous save writes."""
    deadline = time.monotonic() + timeout_s
    markers = [tmp / MARKER.format(rank=r) for r in range(world)]
    kv = dist.distributed_c10d._get_default_store() if world > 1 else None
    while not all(m.exists() for m in markers):
        if kv is not None and kv.check([failed_key]):
            raise OtherRankFailed(kv.get(failed_key).decode())
        if time.monotonic() > deadline:
            missing = [r for r, m in enumerate(markers) if not m.exists()]
            raise store.CheckpointError(f"rank(s) {missing} did not finish writing {tmp} within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    files = []
    for m in markers:
        record = json.loads(m.read_text())
        if set(record) != {"file", "sha256", "bytes"}:
            raise store.CheckpointError(f"{m} is not a rank's file record: it was replaced while the save ran")
        files.append(record)
        m.unlink()
    return files
