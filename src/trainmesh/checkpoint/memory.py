"""Restart from memory: each rank's latest training state kept in host memory outside its process, and a copy
kept by a rank of another node, so an elastic restart reloads in seconds and loses at most the steps since.

A snapshot is one file in the node's snapshot directory (``/dev/shm``, which outlives the rank processes the
agent kills and respawns): the rank's pieces with their global boxes, as a checkpoint's, in safetensors bytes
behind a JSON header, the whole under one SHA-256. Names carry the run's id, so another job's are never read;
a restarted round loads any layout from them (resharding, :func:`trainmesh.checkpoint.store.fill`). Details:
docs/multinode.md#restart-from-memory."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from trainmesh.checkpoint.store import (CheckpointError, TrainingProgress, all_gather_json, apply_rng,
                                        fill, host_pieces, local_state, notice, rng_state)
from trainmesh.distributed.elastic import SNAPSHOT_DIR_ENV
from trainmesh.distributed.mesh import Mesh, world_env
from trainmesh.training.engine import Engine

DEFAULT_DIR = "/dev/shm/trainmesh-snapshots"
MAGIC = b"TMSNAP1\n"
DIGEST = 32
COST_SHARE = 0.1
"""``--memory-snapshot auto`` snapshots every N steps, the smallest N that keeps the measured snapshot time at
most this share of the training time between two snapshots."""
KINDS = ("own", "peer")


class SnapshotDamaged(CheckpointError):
    """A snapshot file that is not whole, not of this run, or whose bytes do not match their SHA-256."""


def snapshot_dir() -> Path:
    return Path(os.environ.get(SNAPSHOT_DIR_ENV) or DEFAULT_DIR)


def segment(root: Path, run_id: str, rank: int, step: int, kind: str) -> Path:
    """The file holding rank ``rank``'s snapshot of run ``run_id`` after ``step`` steps: its own copy, or the
    copy a peer keeps."""
    return root / f"trainmesh-{run_id}-rank{rank:05d}-step{step:08d}.{kind}"


def _segment_pattern(run_id: str) -> re.Pattern[str]:
    return re.compile(rf"trainmesh-{re.escape(run_id)}-rank\d{{5}}-step(\d{{8,}})\.({'|'.join(KINDS)})")


def snapshot_every(snapshot_s: float, step_s: float) -> int:
    """``auto``'s interval: the smallest N for which a snapshot costs at most :data:`COST_SHARE` of N steps."""
    return max(1, math.ceil(snapshot_s / (COST_SHARE * step_s))) if step_s > 0 else 1


def encode(header: dict, payload: bytes) -> bytes:
    """``MAGIC``, the SHA-256 of the rest, the header's length (8 bytes), the JSON header, the payload."""
    head = json.dumps(header).encode()
    body = len(head).to_bytes(8, "little") + head + payload
    return MAGIC + hashlib.sha256(body).digest() + body


def decode(blob: bytes | memoryview, run_id: str, where: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of snapshot bytes ``blob`` once they proved whole and of run ``run_id``; else
    :class:`SnapshotDamaged` naming ``where``. Nothing is parsed before the digest matches."""
    view = memoryview(blob)
    start = len(MAGIC) + DIGEST
    if len(view) < start + 8 or bytes(view[:len(MAGIC)]) != MAGIC:
        raise SnapshotDamaged(f"memory snapshot {where} is not a trainmesh snapshot (too short or no {MAGIC!r})")
    if hashlib.sha256(view[start:]).digest() != bytes(view[len(MAGIC):start]):
        raise SnapshotDamaged(f"memory snapshot {where} does not match its SHA-256 (corrupted)")
    size = int.from_bytes(view[start:start + 8], "little")
    header = json.loads(bytes(view[start + 8:start + 8 + size]))
    if header.get("run") != run_id:
        raise SnapshotDamaged(f"memory snapshot {where} belongs to run {header.get('run')}, not {run_id}")
    try:
        return header, safetensors.torch.load(bytes(view[start + 8 + size:]))
    except SafetensorError as e:
        raise SnapshotDamaged(f"memory snapshot {where} matches its SHA-256 but holds no tensors ({e})") from None


def _write(path: Path, blob: bytes) -> None:
    """Replace ``path`` by ``blob`` in one rename, so a reader never sees half a snapshot."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def _say_once_per_node(text: str) -> None:
    """Say ``text`` from the node's first rank: every rank of a node reads the same files."""
    if world_env().local_rank == 0:
        print(f"trainmesh: {text}", file=sys.stderr, flush=True)


def partner(rank: int, world: int, per_node: int) -> int:
    """The rank that keeps ``rank``'s copy: the same local rank on the next node (ranks are numbered node by
    node), or the next rank where the world is one node (the copy then survives a rank's loss, not the node's)."""
    return (rank + per_node) % world if world > per_node else (rank + 1) % world


def _gloo_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """The world over Gloo, whose sends carry host bytes: the default group on CPU (or for one process, none), a
    new one beside NCCL."""
    return None if mesh.device.type == "cpu" or not dist.is_initialized() else dist.new_group(backend="gloo")


@dataclass
class SnapshotCost:
    """What the last snapshot cost this rank: bytes kept (its own copy) and seconds (copy, write, exchange)."""

    nbytes: int = 0
    seconds: float = 0.0


class MemorySnapshots:
    """Takes this rank's snapshots every ``every`` steps (0: chosen after the first by :data:`COST_SHARE`),
    keeps the two newest in its node's directory and sends a copy to :func:`partner`, which keeps it in its
    own: a node lost while the ranks exchange one snapshot leaves the previous one complete."""

    def __init__(self, mesh: Mesh, run_id: str, every: int = 0, root: Path | None = None) -> None:
        env = world_env()
        self.mesh, self.run_id, self.every, self.root = mesh, run_id, every, root or snapshot_dir()
        self.rank, self.world = env.rank, env.world_size
        self.to = partner(self.rank, self.world, env.local_world_size)
        self.source = next(r for r in range(self.world) if partner(r, self.world, env.local_world_size) == self.rank)
        self.group = _gloo_group(mesh)
        self.cost = SnapshotCost()
        self.kept: list[int] = []
        self.root.mkdir(parents=True, exist_ok=True)

    def due(self, step: int) -> bool:
        return self.every == 0 or step % self.every == 0

    def after_step(self, model: nn.Module, engine: Engine, progress: TrainingProgress, step_s: float) -> None:
        """Snapshot after ``progress.step`` steps if due. The first one's cost, against ``step_s`` (the slowest
        rank's of each, agreed by all so every rank snapshots at the same steps), fixes ``every`` under ``auto``
        and is said in one line."""
        if not self.due(progress.step):
            return
        first = not self.cost.seconds
        self.take(model, engine, progress)
        if not first:
            return
        costs = all_gather_json([self.cost.nbytes, self.cost.seconds, step_s], self.mesh.device)
        nbytes, snap, step = (max(c[i] for c in costs) for i in range(3))
        if self.every == 0:
            self.every = snapshot_every(snap, step)
        notice(f"memory snapshots: {nbytes / 2**20:.2f} MiB per rank (and a peer's copy), {snap:.3f} s each "
               f"against a {step:.3f} s step; every {self.every} step(s)")

    def take(self, model: nn.Module, engine: Engine, progress: TrainingProgress) -> None:
        """Keep this rank's state after ``progress.step`` steps here and at its partner (a collective)."""
        start = time.perf_counter()
        pieces = host_pieces(local_state(model, engine) + rng_state(self.rank, self.mesh.device))
        scaler = engine.scaler
        header = {"run": self.run_id, "rank": self.rank, "world_size": self.world, "step": progress.step,
                  "progress": {"skipped_steps": progress.skipped_steps,
                               "bad_steps_in_a_row": progress.bad_steps_in_a_row},
                  "loss_scaler": {"scale": scaler.scale, "clean_steps": scaler.clean_steps,
                                  "skipped_steps": scaler.skipped_steps},
                  "plan": [item for item, _ in pieces.values()]}
        blob = encode(header, safetensors.torch.save({key: data for key, (_, data) in pieces.items()}))
        _write(segment(self.root, self.run_id, self.rank, progress.step, "own"), blob)
        if self.to != self.rank:  # a world of one has no peer to keep a copy
            _write(segment(self.root, self.run_id, self.source, progress.step, "peer"), self._exchange(blob))
        self.cost = SnapshotCost(len(blob), time.perf_counter() - start)
        self.kept = [*self.kept[-1:], progress.step]
        if len(self.kept) == 2:  # two generations: a kill during one snapshot leaves the last one whole
            discard(self.root, self.run_id, before=self.kept[0])

    def _exchange(self, blob: bytes) -> bytes:
        """Send ``blob`` to the partner and return what the rank this one keeps a copy of sent."""
        out = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        size = torch.zeros(1, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, torch.tensor([out.numel()]), self.to, self.group),
               dist.P2POp(dist.irecv, size, self.source, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        into = torch.empty(int(size.item()), dtype=torch.uint8)
        ops = [dist.P2POp(dist.isend, out, self.to, self.group), dist.P2POp(dist.irecv, into, self.source, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return into.numpy().tobytes()

    def remove(self) -> None:
        """Delete this run's snapshots on this node, an earlier world's too, once every rank has written its last
        (a collective): at a run's clean end, where disk checkpoints stay for later."""
        if dist.is_initialized():
            dist.barrier(self.group)
        discard(self.root, self.run_id)


def discard(root: Path, run_id: str, before: int | None = None) -> None:
    """Delete the snapshots of run ``run_id`` in ``root`` (half-written ones too), or only those of steps before
    ``before``: every rank snapshots at the same steps, so older ones, an earlier world's too, are stale."""
    pattern = _segment_pattern(run_id)
    for path in root.iterdir() if root.is_dir() else []:
        match = pattern.fullmatch(path.name.removeprefix(".tmp-"))
        if match and (before is None or int(match.group(1)) < before):
            path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Copy:
    """A verified snapshot found in this node's directory: whose (``rank``), at which step and world."""

    rank: int
    step: int
    world: int
    path: Path


def _local_copies(root: Path, run_id: str) -> dict[int, list[Copy]]:
    """Every verified snapshot of each old rank this node holds (its own copy first); a damaged one is refused
    in one line, and the other copy (if any) used."""
    pattern, found = _segment_pattern(run_id), {}
    for path in sorted(root.iterdir(), key=lambda p: not p.name.endswith(".own")) if root.is_dir() else []:
        if not pattern.fullmatch(path.name):
            continue
        try:
            header, _ = decode(path.read_bytes(), run_id, path)
        except (SnapshotDamaged, OSError, ValueError) as e:
            _say_once_per_node(f"{e}; not used, the other copy is tried")
            continue
        found.setdefault(header["rank"], []).append(Copy(header["rank"], header["step"], header["world_size"], path))
    return found


def _choose(held: list[dict[str, list[list[int]]]]) -> tuple[int, int] | None:
    """The newest (step, world) of which every old rank's snapshot is held by some new rank; None if none is."""
    complete = []
    for step, world in {tuple(v) for h in held for copies in h.values() for v in copies}:
        if all(any([step, world] in h.get(str(k), []) for h in held) for k in range(world)):
            complete.append((step, world))
    return max(complete, default=None)


def _share(blob: bytes | None, holder: int, group: dist.ProcessGroup | None) -> bytes:
    """``holder``'s ``blob`` on every rank (a broadcast over Gloo), for ranks whose node lacks that copy."""
    size = torch.tensor([len(blob) if blob is not None else 0])
    dist.broadcast(size, holder, group)
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob is not None \
        else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, holder, group)
    return data.numpy().tobytes()


def restore(model: nn.Module, engine: Engine, mesh: Mesh, run_id: str, root: Path | None = None,
            group: dist.ProcessGroup | None = None) -> TrainingProgress | None:
    """Load run ``run_id``'s newest complete snapshot (every old rank's own or peer copy, found on any node)
    into this rank's part of ``model`` and ``engine`` in their layout, resharding from the old one; its
    progress, or None where no complete one is left, saying so in one line where some are (a collective).
    Copies only another node holds are broadcast from one that does."""
    rank = world_env().rank
    mine = _local_copies(root or snapshot_dir(), run_id)
    held = all_gather_json({str(k): [[c.step, c.world] for c in copies] for k, copies in mine.items()},
                           mesh.device)
    chosen = _choose(held)
    if chosen is None:
        if any(held):
            notice(f"no complete memory snapshot of run {run_id} is left on these nodes (both copies of a rank's "
                   f"state are gone); resuming from disk")
        return None
    step, world = chosen
    snapshots = {}
    for k in range(world):
        holders = [r for r, h in enumerate(held) if [step, world] in h.get(str(k), [])]
        path = next((c.path for c in mine.get(k, []) if (c.step, c.world) == chosen), None)
        blob = path.read_bytes() if path is not None else None
        if len(holders) < len(held):
            blob = _share(blob if rank == holders[0] else None, holders[0], group)
        snapshots[k] = decode(blob, run_id, path or Path(f"rank {holders[0]}'s copy"))
    _load(model, engine, mesh, snapshots, world)
    header = snapshots[0][0]
    for key, value in header["loss_scaler"].items():
        setattr(engine.scaler, key, value)
    engine.after_update()
    return TrainingProgress(step, **header["progress"], run_id=run_id)


def _load(model: nn.Module, engine: Engine, mesh: Mesh, snapshots: dict[int, tuple[dict, dict]], world: int) -> None:
    """Fill this rank's state from the old ranks' pieces (each piece read once, from the first rank holding it);
    generator states only in the same world, as a checkpoint's."""
    index: dict[str, dict] = {}
    for k, (header, _) in snapshots.items():
        for item in header["plan"]:
            entry = index.setdefault(item["name"], {"shape": item["shape"], "dtype": item["dtype"], "pieces": []})
            if all(p["key"] != item["key"] for p in entry["pieces"]):
                entry["pieces"].append({"key": item["key"], "file": str(k), "offsets": item["offsets"],
                                        "sizes": item["sizes"]})
    rank = world_env().rank
    rng = rng_state(rank, mesh.device) if world == mesh.world_size else []
    source = Path("memory snapshots")
    fill(local_state(model, engine, listed=index) + rng, index, lambda k: snapshots[int(k)][1], source,
         lambda what: SnapshotDamaged(f"the memory snapshots do not fit this model: {what}"))
    apply_rng(rng, {"tensors": index}, source, mesh.device)

