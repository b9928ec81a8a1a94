"""Sharded checkpoints: every rank writes only what it holds, and any layout can read them back.

A checkpoint is ``step-N/`` with one safetensors file per rank and a JSON ``manifest.json`` listing, per
global tensor, the boxes each file holds; loading copies the intersections with the boxes this rank needs
in its layout (resharding). Nothing read is unpickled or trusted before the manifest schema and file hashes
pass; a save publishes by rename, so a crash leaves the previous ``latest``. Format: docs/checkpoints.md."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from trainmesh.distributed.comm import log_all_gather
from trainmesh.training.engine import Engine
from trainmesh.checkpoint.manifest import FORMAT, VERSION, ManifestError, check_manifest, check_tiling, show
from trainmesh.distributed.mesh import Mesh, world_from_env
from trainmesh.models import moe
from trainmesh.training.precision import LossScaler
from trainmesh.storage.safe_io import (IntegrityError, check_regular, fsync_dir, inside, read_regular, read_verified,
                               remove_entry, replace_durably, sha256_hex, write_durably)
from trainmesh.parallel.expert_parallel import place_experts
from trainmesh.parallel.tensor_parallel import Box, shard_boxes
from trainmesh.data.tokenizer import TOKENIZER_FILE, TokenizerFile, tokenizer_record


MANIFEST, LATEST, LOCK = "manifest.json", "latest", "trainmesh.lock"
HF_PREFIX = "hf-"  # ``hf-<name>``: a kept file of the run's ``--init-hf`` source, beside the shards


STEP_DIR = re.compile(r"step-(\d{8,})")  # 8 digits at least, more past step 99,999,999


LEFTOVER = re.compile(r"\.(tmp|replaced|pruned)-step-\d{8,}")


MANIFEST_LIMIT = 2**30


RUN_ID_ENV = "TRAINMESH_RUN_ID"  # set by the launching process (:func:`claim`) for the ranks it starts
MOMENTS = ("exp_avg", "exp_avg_sq")


DTYPES = {str(t).removeprefix("torch."): t
          for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)}


SCALAR = Box(torch.Size([]), torch.Size([]))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and what to do."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit this run (another model): no older checkpoint would fit either."""


class CheckpointDamaged(CheckpointError):
    """Checkpoint ``path`` cannot be used as it is on disk; ``detail`` names the file and what is wrong."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"checkpoint {path} is damaged: {' '.join(detail.split())}")


class CheckpointOfAnotherRun(CheckpointError):
    """A sound checkpoint written by a run other than the one being resumed: never a fallback."""


@dataclass(frozen=True)
class TrainingProgress:
    """The loop's state besides tensors: steps done and the non-finite step counters."""

    step: int = 0
    skipped_steps: int = 0
    bad_steps_in_a_row: int = 0
    run_id: str = ""  # the run these steps belong to (recorded in each manifest's ``run``, not ``progress``)


@dataclass
class LocalTensor:
    """Part of global tensor ``name`` (of ``shape``) as this rank holds it: the contents of ``boxes``, read
    row-major and concatenated, are ``views[0]``. Every tensor in ``views`` (the fp32 master and the
    model's low-precision copy) holds those elements, and each is written on load."""

    name: str
    shape: tuple[int, ...]
    boxes: list[Box]
    views: list[torch.Tensor]


def box_numel(box: Box) -> int:
    return math.prod(box.sizes)


def whole(shape: tuple[int, ...]) -> Box:
    return Box(torch.Size([0] * len(shape)), torch.Size(shape))


def _row_part(offsets: tuple[int, ...], sizes: tuple[int, ...], a: int, b: int, inner: int) -> list[Box]:
    """Elements ``[a, b)`` of a box, all within one of its rows (``inner`` elements each)."""
    if a >= b:
        return []
    row = a // inner
    return [Box(torch.Size([offsets[0] + row, *sub.offsets]), torch.Size([1, *sub.sizes]))
            for sub in _range_boxes(offsets[1:], sizes[1:], a - row * inner, b - row * inner)]


def _range_boxes(offsets: tuple[int, ...], sizes: tuple[int, ...], a: int, b: int) -> list[Box]:
    """Elements ``[a, b)`` of a box read row-major, as boxes: a partial first row, whole rows, a partial
    last row (the partial rows split the same way, one dimension down)."""
    if a >= b:
        return []
    if not sizes:
        return [SCALAR]
    inner = math.prod(sizes[1:])
    head_end = min(b, -(-a // inner) * inner)
    tail_start = max(head_end, b // inner * inner)
    rows = []
    if tail_start > head_end:
        rows = [Box(torch.Size([offsets[0] + head_end // inner, *offsets[1:]]),
                    torch.Size([(tail_start - head_end) // inner, *sizes[1:]]))]
    return _row_part(offsets, sizes, a, head_end, inner) + rows + _row_part(offsets, sizes, tail_start, b, inner)


def flat_range_boxes(boxes: list[Box], start: int, end: int) -> list[Box]:
    """Elements ``[start, end)`` of the row-major concatenation of ``boxes``, as boxes: where a ZeRO piece
    of a (tensor-parallel) tensor lies in the full tensor."""
    out, base = [], 0
    for box in boxes:
        n = box_numel(box)
        out += _range_boxes(tuple(box.offsets), tuple(box.sizes), max(start - base, 0), min(end - base, n))
        base += n
    return out


def intersect(a: Box, b: Box) -> Box | None:
    lo = [max(x, y) for x, y in zip(a.offsets, b.offsets)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes)]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return Box(torch.Size(lo), torch.Size([h - low for low, h in zip(lo, hi)]))


def region(t: torch.Tensor, box: Box, within: Box) -> torch.Tensor:
    """The part ``box`` of ``t``, a tensor holding the contents of box ``within`` (a view)."""
    return t[tuple(slice(o - w, o - w + s) for o, s, w in zip(box.offsets, box.sizes, within.offsets))]


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the AdamW state its first step would (zero moments, step 0), so a fresh
    optimizer can be loaded into and one that has skipped every step can be saved. Through
    ``load_state_dict``, which places each tensor where the optimizer's own policy wants it (the step on
    the device for the fused kernel)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    state = optimizer.state_dict()
    for i, p in enumerate(params):
        if not state["state"].get(i):
            state["state"][i] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
    optimizer.load_state_dict(state)


def local_state(model: nn.Module, engine: Engine, listed: Collection[str] = ()) -> list[LocalTensor]:
    """Every tensor of training state this rank holds (its part of ``model`` and ``engine``'s optimizer),
    each placed in its global tensor; with the routing biases ``listed`` names (:func:`routing_state`)."""
    geometry = place_experts(shard_boxes(model), model)
    optimizer = engine.optimizer
    ensure_optimizer_state(optimizer)
    out = []
    for piece in engine.param_pieces():
        shape, local = geometry[piece.name]
        boxes = flat_range_boxes(local, piece.start, piece.end)
        state = optimizer.state[piece.optim_param]
        out.append(LocalTensor(f"model/{piece.name}", tuple(shape), boxes, [piece.master, piece.param]))
        out += [LocalTensor(f"optim/{piece.name}/{k}", tuple(shape), boxes, [state[k].view(-1)]) for k in MOMENTS]
        out.append(LocalTensor(f"optim/{piece.name}/step", (), [SCALAR], [state["step"].view(-1)]))
    return out + routing_state(model, listed)


def routing_state(model: nn.Module, listed: Collection[str] = ()) -> list[LocalTensor]:
    """The routing bias of every MoE layer of ``model`` that the aux-loss-free update moves, that is not 0 (an
    imported DeepSeek-V3's ``e_score_correction_bias``) or that ``listed`` (the names a checkpoint holds)
    names: without it a resumed run or an export would route as if the bias were back at 0. A layer whose
    bias stays 0 saves nothing, so checkpoints written before biases were saved still load."""
    return [LocalTensor(f"buffer/{name}.router.expert_bias", tuple(layer.router.expert_bias.shape),
                        [whole(tuple(layer.router.expert_bias.shape))], [layer.router.expert_bias.view(-1)])
            for name, layer in moe.moe_layers(model)
            if layer.cfg.bias_rate or layer.router.expert_bias.any() or f"buffer/{name}.router.expert_bias" in listed]


def rng_state(rank: int, device: torch.device) -> list[LocalTensor]:
    """This rank's generator states (copies; :func:`set_rng_state` applies loaded ones)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return [LocalTensor(f"rng/{rank}/{kind}", tuple(t.shape), [whole(tuple(t.shape))], [t])
            for kind, t in states.items()]


def set_rng_state(tensors: list[LocalTensor], device: torch.device) -> None:
    """Apply loaded generator states; torch validates each (a replaced one raises ``RuntimeError``)."""
    for t in tensors:
        if t.name.endswith("/cpu"):
            torch.set_rng_state(t.views[0])
        else:
            torch.cuda.set_rng_state(t.views[0], device)


def all_gather_json(obj: Any, device: torch.device, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` over ``group`` (the world by default), in rank order, as JSON bytes in tensors
    (``all_gather_object`` would unpickle)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    lengths = log_all_gather(torch.tensor([data.numel()], device=device), group).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    rows = log_all_gather(padded, group).cpu()
    return [json.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def on_every_rank(action: Callable[[], Any], device: torch.device, what: str) -> list[Any]:
    """Run ``action`` on every rank and return every rank's result; if it failed on any rank, raise on all
    of them, naming the ranks and their errors, so no rank is left waiting in a collective."""
    try:
        result, error, cause = action(), None, None
    except Exception as e:  # noqa: BLE001 - any failure must reach every rank, or the others would hang
        result, error, cause = None, f"{type(e).__name__}: {e}", e
    outcomes = all_gather_json({"result": result, "error": error}, device)
    failed = {r: o["error"] for r, o in enumerate(outcomes) if o["error"]}
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {detail}") from cause
    return [o["result"] for o in outcomes]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def notice(text: str) -> None:
    if world_from_env()[0] == 0:
        print(f"trainmesh: {text}", file=sys.stderr, flush=True)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def step_of(path: Path) -> int:
    """The step of a ``step-N`` directory, by number: names of any width sort by the step they hold."""
    return int(path.name.removeprefix("step-"))


class HostBuffers:
    """Pinned host memory that background saves stage GPU state into, kept from one save to the next.

    Pinned copies run at the link's rate without blocking the host, but pinning is slow, so each piece's
    buffer is allocated once and reused (as torchtitan does): safe since at most one save is in flight."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending_gpu_copies = False

    def copy(self, key: str, src: torch.Tensor) -> torch.Tensor:
        if src.device.type != "cuda":
            return src.to("cpu", copy=True)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = self._buffers[key] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self._pending_gpu_copies = True
        return buf.copy_(src, non_blocking=True)

    def settle(self) -> None:
        """Wait for the copies in flight: training may overwrite their sources once staging returns."""
        if self._pending_gpu_copies:
            torch.cuda.synchronize()
            self._pending_gpu_copies = False


def host_pieces(tensors: list[LocalTensor], host: HostBuffers | None = None) -> dict[str, tuple[dict, torch.Tensor]]:
    """This rank's pieces, by key: their description for the plan and a CPU copy of their data (into
    ``host``'s reused pinned buffers where given: a synchronous save keeps no buffers between saves)."""
    out = {}
    copy = host.copy if host is not None else lambda _key, src: src.to("cpu", copy=True)
    for t in tensors:
        flat, base = t.views[0].detach(), 0
        for box in t.boxes:
            n = box_numel(box)
            key = f"{t.name}@{','.join(map(str, box.offsets))}"
            data = copy(key, flat[base:base + n].view(box.sizes))
            out[key] = ({"key": key, "name": t.name, "shape": list(t.shape), "dtype": dtype_name(flat.dtype),
                         "offsets": list(box.offsets), "sizes": list(box.sizes), "nbytes": n * flat.element_size()},
                        data)
            base += n
    if host is not None:
        host.settle()
    return out


def assign_writers(plans: list[list[dict]]) -> dict[str, int]:
    """Which rank writes each piece: one held by several ranks (a replica) goes to the holder with the
    fewest bytes so far, biggest pieces first. Every rank computes the same assignment from the same plans."""
    holders: dict[str, list[int]] = defaultdict(list)
    nbytes: dict[str, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan:
            holders[item["key"]].append(rank)
            nbytes[item["key"]] = item["nbytes"]
    load = [0] * len(plans)
    writers = {}
    for key in sorted(holders, key=lambda k: (-nbytes[k], k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        writers[key] = rank
        load[rank] += nbytes[key]
    return writers


def _fresh_dir(path: Path) -> None:
    """An empty staging directory ``path``: a leftover of an interrupted save there is removed first, a
    symbolic link by unlinking it (what it leads to is never touched)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_entry(path)
    path.mkdir()


def _write_rank_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    data = safetensors.torch.save(tensors)
    write_durably(path, data)
    return {"file": path.name, "sha256": sha256_hex(data), "bytes": len(data)}


def content_hash(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return sha256_hex(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _manifest(description: dict, scaler: LossScaler, progress: TrainingProgress, plans: list[list[dict]],
              writers: dict[str, int], files: list[dict]) -> dict:
    tensors: dict[str, dict] = {}
    for rank, plan in enumerate(plans):
        for item in plan:
            if writers[item["key"]] != rank:
                continue
            entry = tensors.setdefault(item["name"], {"shape": item["shape"], "dtype": item["dtype"], "pieces": []})
            entry["pieces"].append({"key": item["key"], "file": files[rank]["file"], "offsets": item["offsets"],
                                    "sizes": item["sizes"]})
    manifest = {
        "format": FORMAT, "version": VERSION, "step": progress.step,
        "progress": {k: v for k, v in dataclasses.asdict(progress).items() if k != "run_id"},
        "run": {"id": progress.run_id, "config_sha256": sha256_hex(json.dumps(description["config"],
                                                                              sort_keys=True).encode())},
        "loss_scaler": {"scale": scaler.scale, "clean_steps": scaler.clean_steps,
                        "skipped_steps": scaler.skipped_steps},
        "model": description["model"], "model_source": description["model_source"],
        "config": description["config"], "layout": description["layout"],
        "tokenizer": tokenizer_record(description.get("tokenizer")),
        **({"hf_files": {name: {"sha256": sha256_hex(f.data), "bytes": len(f.data), "mode": f.mode}
                         for name, f in description["hf_files"].items()}} if description.get("hf_files") else {}),
        "tensors": dict(sorted(tensors.items())),
        "files": {f["file"]: {"sha256": f["sha256"], "bytes": f["bytes"]} for f in files},
    }
    manifest["sha256"] = content_hash(manifest)
    return manifest


def kept_tokenizer(path: Path, record: dict) -> TokenizerFile:
    """The copy of its tokenizer checkpoint ``path`` keeps (manifest ``record`` of kind ``copy``), read from
    the step directory only, never through a link, and checked against the recorded size and SHA-256; a copy
    that is missing or altered is :class:`IntegrityError`."""
    data = read_verified(inside(path, TOKENIZER_FILE), record["sha256"], record["bytes"])
    return TokenizerFile(str(path / TOKENIZER_FILE), data, record["sha256"])


@dataclass(frozen=True)
class KeptFile:
    """A file of the run's ``--init-hf`` source that its checkpoints keep, so an export never reads the source
    again: its bytes and its permissions (at most ``0644``)."""

    data: bytes = dataclasses.field(repr=False)
    mode: int


def kept_file(path: Path, name: str, record: dict) -> bytes:
    """The bytes of kept file ``name`` of checkpoint ``path`` (its manifest's ``hf_files`` ``record``), read
    from the step directory only, never through a link, and checked against the recorded size and SHA-256."""
    return read_verified(inside(path, HF_PREFIX + name), record["sha256"], record["bytes"])


def _publish(tmp: Path, final: Path, manifest: dict, description: dict) -> None:
    """Write the copy of the run's tokenizer (if a file), its kept ``--init-hf`` files and the manifest, make
    the directory ``final`` in one rename, then point ``latest`` at it."""
    if description.get("tokenizer") is not None:
        write_durably(tmp / TOKENIZER_FILE, description["tokenizer"].data)
    for name, kept in description.get("hf_files", {}).items():
        write_durably(tmp / (HF_PREFIX + name), kept.data, kept.mode)
    write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    replaced = final.with_name(f".replaced-{final.name}")
    if os.path.lexists(final):
        remove_entry(replaced)
        os.rename(final, replaced)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    remove_entry(replaced)
    replace_durably(final.parent / LATEST, f"{final.name}\n".encode())

def agreed_run_id(device: torch.device) -> str:
    """``TRAINMESH_RUN_ID`` if the launching process set it, else a new id rank 0 draws (a collective)."""
    return all_gather_json(os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex, device)[0]


@dataclass(frozen=True)
class PlannedSave:
    """A save planned on every rank before anything is written: where it goes (``tmp``, renamed to ``final``
    when published), every rank's pieces (``plans``) and who writes each (``writers``), and the pieces this
    ``rank`` writes (``ours``). The synchronous and the background save write exactly this."""

    rank: int
    device: torch.device
    progress: TrainingProgress
    final: Path
    tmp: Path
    plans: list
    writers: dict
    ours: dict


def stage(model: nn.Module, engine: Engine, mesh: Mesh, root: Path, progress: TrainingProgress,
          host: HostBuffers | None = None) -> PlannedSave:
    """Gather what every rank holds of ``model`` and ``engine`` (copied into ``host``'s buffers where given)
    and assign each piece one writer (a collective); the run's id is agreed here if ``progress`` has none."""
    rank, device = world_from_env()[0], mesh.device
    if not progress.run_id:
        progress = dataclasses.replace(progress, run_id=agreed_run_id(device))
    final = step_dir(root, progress.step)
    mine = host_pieces(local_state(model, engine) + rng_state(rank, device), host)
    plans = all_gather_json([item for item, _ in mine.values()], device)
    writers = assign_writers(plans)
    ours = {key: data for key, (_, data) in mine.items() if writers[key] == rank}
    return PlannedSave(rank, device, progress, final, final.with_name(f".tmp-{final.name}"), plans, writers, ours)



def save_state(model: nn.Module, engine: Engine, mesh: Mesh, root: Path, progress: TrainingProgress,
               description: dict, keep_last: int = 0) -> Path:
    """Save this rank's part of ``model`` and ``engine``'s optimizer as ``root/step-N`` (a collective), with
    ``description`` in the manifest, then :func:`prune` beyond ``keep_last``. A failure on any rank is raised
    on every rank, and the previous checkpoint stays ``latest``."""
    start = time.perf_counter()
    staged = stage(model, engine, mesh, root, progress)
    rank, device, final, tmp = staged.rank, staged.device, staged.final, staged.tmp
    try:
        on_every_rank(lambda: _fresh_dir(tmp) if rank == 0 else None, device, f"creating {tmp}")
        files = on_every_rank(lambda: _write_rank_file(tmp / f"rank-{rank:05d}.safetensors", staged.ours), device,
                               f"writing the shards of {final}")
        on_every_rank(lambda: _publish(tmp, final, _manifest(description, engine.scaler, staged.progress,
                                                              staged.plans, staged.writers, files),
                                       description)
                      if rank == 0 else None,
                       device, f"publishing {final}")
    except CheckpointError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = next((p.name for p in candidates(final.parent)), None)
        raise CheckpointError(f"saving checkpoint {final} failed: {e}; the previous checkpoint "
                              f"({previous or 'none'}) is untouched and --resume will use it; free space in "
                              f"{final.parent} or choose another --checkpoint-dir") from e
    size = sum(f["bytes"] for f in files)
    pruned = prune(final, keep_last) if rank == 0 else []
    gone = f"; deleted {', '.join(p.name for p in pruned)} (--keep-last {keep_last})" if pruned else ""
    notice(f"saved {final} ({len(files)} files, {size / 2**20:.1f} MiB) in {time.perf_counter() - start:.2f} s{gone}")
    return final


def prune(published: Path, keep_last: int) -> list[Path]:
    """Delete the sound checkpoints older than ``published`` beyond the ``keep_last`` newest (``published``
    counted), oldest first; returns those deleted. Only real ``step-N`` directories are looked at, each renamed
    to ``.pruned-step-N`` before deletion so a crash leaves no damaged ``step-N``; newer ones and ``latest``'s
    are never touched, and a failed deletion is said, not raised."""
    root = published.parent
    if keep_last <= 0:
        return []
    older = sorted((p for p in root.iterdir() if _own_step(p) and step_of(p) < step_of(published)), key=step_of)
    sound = [p for p in older if _sound(p)]
    if len(sound) < keep_last - 1:
        return []
    oldest_kept = step_of(sound[len(sound) - (keep_last - 1)]) if keep_last > 1 else step_of(published)
    latest, pruned = _latest_name(root), []
    for path in older:
        if step_of(path) >= oldest_kept or path.name == latest:
            continue
        doomed = path.with_name(f".pruned-{path.name}")
        try:
            remove_entry(doomed)
            os.rename(path, doomed)
            remove_entry(doomed)
        except OSError as e:
            notice(f"could not delete old checkpoint {path} ({e}); delete it yourself")
            continue
        pruned.append(path)
    if pruned:
        fsync_dir(root)
    return pruned


def _own_step(path: Path) -> bool:
    """Whether ``path`` is a checkpoint a save made: a directory, not a link, named as :func:`step_dir` names."""
    return (STEP_DIR.fullmatch(path.name) is not None and path.name == step_dir(path.parent, step_of(path)).name
            and not path.is_symlink() and path.is_dir())


def _sound(path: Path) -> bool:
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory ``path`` once it has proved sound: :func:`parse_manifest`'s,
    every file it lists a regular file in ``path`` of the recorded size, and then (the files' sizes bounding
    the work) every tensor's pieces tiling it. Else :class:`CheckpointDamaged`."""
    manifest = parse_manifest(path)
    try:
        for name, entry in manifest["files"].items():
            check_regular(inside(path, name), entry["bytes"])
        check_tiling(manifest)
    except IntegrityError as e:
        raise CheckpointDamaged(path, str(e)) from None
    except ManifestError as e:
        raise CheckpointDamaged(path, f"{path / MANIFEST}: {e}") from None
    return manifest


def parse_manifest(path: Path) -> dict:
    """The manifest of ``path`` parsed as JSON only (nothing on disk is ever unpickled), matching its own
    SHA-256 and inside the schema (:mod:`trainmesh.checkpoint.manifest`); its files are not looked at (nor, since that
    needs their sizes, whether its pieces tile their tensors)."""
    file = path / MANIFEST
    try:
        manifest = json.loads(read_regular(file, MANIFEST_LIMIT))
    except IntegrityError as e:
        raise CheckpointDamaged(path, str(e)) from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointDamaged(path, f"{file} is not valid JSON ({e}): it was damaged or replaced") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointDamaged(path, f"{file} is not a trainmesh checkpoint manifest (format {FORMAT} version "
                                      f"{VERSION})")
    if manifest.get("sha256") != content_hash(manifest):
        raise CheckpointDamaged(path, f"{file} does not match its own SHA-256: it was edited or corrupted after "
                                      f"it was written")
    try:
        check_manifest(manifest, path.resolve().name)
    except ManifestError as e:
        raise CheckpointDamaged(path, f"{file}: {e}") from None
    return manifest


def verified_tensors(path: Path, name: str, files: dict) -> dict[str, torch.Tensor]:
    """The tensors of file ``name`` of checkpoint ``path``, parsed only after its bytes proved sound."""
    try:
        data = read_verified(inside(path, name), files[name]["sha256"], files[name]["bytes"])
        return safetensors.torch.load(data)
    except IntegrityError as e:
        raise CheckpointDamaged(path, str(e)) from None
    except SafetensorError as e:
        raise CheckpointDamaged(path, f"{path / name} matches its SHA-256 but is not a safetensors file "
                                      f"({e})") from None


def whole_pieces(tensors: dict[str, torch.Tensor], file: str, prefix: str = "") -> dict[str, dict]:
    """A manifest's index of ``tensors`` held whole in memory: each listed as ``prefix + name``, one piece
    covering all of it, found under its own name in ``file``; for :func:`fill` to reshard from."""
    return {prefix + k: {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                         "pieces": [{"key": k, "file": file, "offsets": [0] * t.dim(), "sizes": list(t.shape)}]}
            for k, t in tensors.items()}


Fault = Callable[[str], CheckpointError]


def fill(wanted: list[LocalTensor], index: dict[str, dict], open_file: Callable[[str], dict[str, torch.Tensor]],
         source: Path, fault: Fault) -> None:
    """Copy into each wanted tensor, box by box, its intersections with the pieces ``index`` lists, reading
    each file once; then write the result into every live view. What ``source`` lacks is ``fault(what)``:
    another model for a weights file, damage for a checkpoint whose model config matched."""
    jobs: dict[str, list] = defaultdict(list)
    buffers = []
    for t in wanted:
        entry = index.get(t.name)
        if entry is None or tuple(entry["shape"]) != t.shape:
            there = "is missing" if entry is None else f"has shape {entry['shape']}"
            raise fault(f"{t.name} {there} there, shape {list(t.shape)} here")
        if entry["dtype"] not in DTYPES:
            raise fault(f"{t.name} is stored as {show(entry['dtype'])}; trainmesh reads {', '.join(DTYPES)}")
        buf = torch.empty(sum(box_numel(b) for b in t.boxes), dtype=DTYPES[entry["dtype"]])
        base = 0
        for box in t.boxes:
            target = buf[base:base + box_numel(box)].view(box.sizes)
            base += box_numel(box)
            for piece in entry["pieces"]:
                saved = Box(torch.Size(piece["offsets"]), torch.Size(piece["sizes"]))
                common = intersect(box, saved)
                if common is not None:
                    jobs[piece["file"]].append((piece["key"], saved, region(target, common, box), common, buf.dtype))
        buffers.append((t, buf))
    for name, file_jobs in jobs.items():
        tensors = open_file(name)
        for key, saved, dst, common, dtype in file_jobs:
            src = tensors.get(key)
            if src is None or src.shape != saved.sizes or src.dtype != dtype:
                raise fault(f"{source / name}: tensor {key} is missing or not the {dtype} of shape "
                            f"{list(saved.sizes)} that the manifest lists")
            dst.copy_(region(src, common, saved))
    with torch.no_grad():
        for t, buf in buffers:
            for view in t.views:
                view.copy_(buf)


def apply_rng(rng: list[LocalTensor], manifest: dict, path: Path, device: torch.device) -> None:
    for t in rng:
        try:
            set_rng_state([t], device)
        except RuntimeError as e:
            file = path / manifest["tensors"][t.name]["pieces"][0]["file"]
            raise CheckpointDamaged(path, f"{file}: {t.name} is not a valid generator state ({e})") from None


def _latest_name(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_DIR.fullmatch(name) else None


def candidates(root: Path) -> list[Path]:
    """Checkpoints to try, best first: the one ``latest`` names, then every other ``step-N``, newest first."""
    steps = sorted((p for p in root.iterdir() if STEP_DIR.fullmatch(p.name)), key=step_of, reverse=True) \
        if root.is_dir() else []
    latest = _latest_name(root)
    return sorted(steps, key=lambda p: p.name != latest)


def read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The full global tensors of checkpoint directory ``path`` whose names start with ``prefix``, each
    assembled from its pieces (in one process, whatever layout wrote them)."""
    manifest = read_manifest(path)
    wanted = []
    for name, entry in manifest["tensors"].items():
        if name.startswith(prefix):
            shape = tuple(entry["shape"])
            flat = torch.empty(math.prod(shape), dtype=DTYPES[entry["dtype"]])
            wanted.append(LocalTensor(name, shape, [whole(shape)], [flat]))
    fill(wanted, manifest["tensors"], lambda name: verified_tensors(path, name, manifest["files"]), path,
         lambda what: CheckpointDamaged(path, what))
    return {t.name: t.views[0].view(t.shape) for t in wanted}
