r"""Sharded checkpoints: every rank writes only what it holds, and any layout can read them back.

Format. A checkpoint is a directory ``step-00000010`` under ``--checkpoint-dir`` holding one safetensors
file per rank and ``manifest.json``. Every tensor of the training state has a *global name* and the
*global shape* a single process would give it:

* ``model/<param>``: the weights under the plain model's names. Under mixed precision these are the fp32
  masters; the bf16/fp16 parameters are exactly those rounded (that is how every step makes them), so
  they are not stored and are rebuilt bit for bit on load;
* ``optim/<param>/exp_avg``, ``optim/<param>/exp_avg_sq``, ``optim/<param>/step``: AdamW's state;
* ``rng/<rank>/cpu`` (and ``cuda``): each rank's generator state, restored when the world size is the one
  that saved it (training itself draws nothing from these generators; in another layout there is no
  rank whose stream would continue).

For each tensor the manifest lists the pieces it was saved in: a box of the global tensor (offsets and
sizes per dimension, as in DCP's ``ChunkStorageMetadata``), the file and the key holding it. The step
(which fixes the data position, since batches are a function of ``(seed, step)``, and the learning rate),
the loss scale, the non-finite step counters, the config and every file's SHA-256 and length go there too.

Geometry. Each parallel form says where its local tensors lie: tensor parallelism gives the boxes of the
full tensor its shard holds (:func:`trainmesh.tensor_parallel.shard_boxes`; three row blocks for a fused
qkv), data parallelism and ZeRO which flat range of that shard the rank's optimizer holds
(``engine.param_pieces()``), and a pipeline stage simply has only its own layers' parameters. A flat range
of boxes is again a list of boxes (:func:`flat_range_boxes`), so every local tensor is a list of boxes of
a global one. Saving writes each box once: replicas (dp ranks without ZeRO, tp ranks for a LayerNorm) are
spread over the ranks holding them by size, as DCP's ``dedup_save_plans`` does, so ranks write in parallel
and about equally. Loading computes the boxes this rank needs in *its* layout and copies in their
intersections with the saved pieces, whatever layout wrote them: that is resharding.

Why not DCP's storage layer: ``FileSystemReader`` unpickles the ``.metadata`` file before anything could
check it, and ZeRO's flat ranges of tp shards are not DTensors. Here the manifest is JSON and the shards are
safetensors (a JSON header and raw bytes), so nothing read from disk is ever unpickled; each file's bytes
are checked against the manifest before they are parsed, and the manifest carries a SHA-256 of its content.

Crash safety. A save writes into ``.tmp-step-N``; each rank ``fsync``\ s its file; rank 0 writes the
manifest, renames the directory to ``step-N`` and then atomically replaces the ``latest`` pointer
(:mod:`trainmesh.safe_io`). A crash or a full disk at any point leaves the previous checkpoint and the
pointer to it untouched. ``--resume`` tries ``latest``, then every other ``step-N``, newest first, and says
which damaged ones it skipped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Box

from trainmesh.comm import log_all_gather
from trainmesh.config import Config
from trainmesh.mesh import world_from_env
from trainmesh.safe_io import IntegrityError, fsync_dir, read_verified, replace_durably, sha256_hex, write_durably
from trainmesh.tensor_parallel import shard_boxes
from trainmesh import zero

if TYPE_CHECKING:
    from trainmesh.train import Run

FORMAT, VERSION = "trainmesh-checkpoint", 1
MANIFEST, LATEST = "manifest.json", "latest"
STEP_DIR = re.compile(r"step-(\d{8})")
MOMENTS = ("exp_avg", "exp_avg_sq")
DTYPES = {str(t).removeprefix("torch."): t
          for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)}
SCALAR = Box(torch.Size([]), torch.Size([]))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and what to do."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit this run (another model): no older checkpoint would fit either."""


@dataclass(frozen=True)
class TrainingProgress:
    """The loop's state besides tensors: steps done and the non-finite step counters."""

    step: int = 0
    skipped_steps: int = 0
    bad_steps_in_a_row: int = 0


@dataclass
class LocalTensor:
    """Part of global tensor ``name`` (of ``shape``) as this rank holds it: the contents of ``boxes``, read
    row-major and concatenated, are ``views[0]``. Every tensor in ``views`` (the fp32 master and the
    model's low-precision copy) holds those elements, and each is written on load."""

    name: str
    shape: tuple[int, ...]
    boxes: list[Box]
    views: list[torch.Tensor]


# --- geometry: boxes of global tensors ---------------------------------------------------------------

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


def _disjoint_cover(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether ``boxes`` lie inside ``shape`` and tile it exactly (no gap, no overlap)."""
    inside = all(len(b.offsets) == len(shape) and all(0 <= o and o + s <= n and s > 0
                                                      for o, s, n in zip(b.offsets, b.sizes, shape)) for b in boxes)
    apart = all(intersect(a, b) is None for i, a in enumerate(boxes) for b in boxes[i + 1:])
    return inside and apart and sum(box_numel(b) for b in boxes) == math.prod(shape)


# --- what a rank holds -------------------------------------------------------------------------------

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


def local_state(run: Run) -> list[LocalTensor]:
    """Every tensor of training state this rank holds, each placed in its global tensor."""
    geometry = shard_boxes(run.model)
    optimizer = run.engine.optimizer
    ensure_optimizer_state(optimizer)
    out = []
    for piece in run.engine.param_pieces():
        shape, local = geometry[piece.name]
        boxes = flat_range_boxes(local, piece.start, piece.end)
        state = optimizer.state[piece.optim_param]
        out.append(LocalTensor(f"model/{piece.name}", tuple(shape), boxes, [piece.master, piece.param]))
        out += [LocalTensor(f"optim/{piece.name}/{k}", tuple(shape), boxes, [state[k].view(-1)]) for k in MOMENTS]
        out.append(LocalTensor(f"optim/{piece.name}/step", (), [SCALAR], [state["step"].view(-1)]))
    return out


def rng_state(rank: int, device: torch.device) -> list[LocalTensor]:
    """This rank's generator states (copies; :func:`set_rng_state` applies loaded ones)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return [LocalTensor(f"rng/{rank}/{kind}", tuple(t.shape), [whole(tuple(t.shape))], [t])
            for kind, t in states.items()]


def set_rng_state(tensors: list[LocalTensor], device: torch.device) -> None:
    for t in tensors:
        if t.name.endswith("/cpu"):
            torch.set_rng_state(t.views[0])
        else:
            torch.cuda.set_rng_state(t.views[0], device)


# --- collectives without pickle ----------------------------------------------------------------------

def _all_gather_json(obj: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in rank order, as JSON bytes in tensors (``all_gather_object`` would unpickle)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    lengths = log_all_gather(torch.tensor([data.numel()], device=device)).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    rows = log_all_gather(padded).cpu()
    return [json.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def _on_every_rank(action: Callable[[], Any], device: torch.device, what: str) -> list[Any]:
    """Run ``action`` on every rank and return every rank's result; if it failed on any rank, raise on all
    of them, naming the ranks and their errors, so no rank is left waiting in a collective."""
    try:
        result, error, cause = action(), None, None
    except Exception as e:  # noqa: BLE001 - any failure must reach every rank, or the others would hang
        result, error, cause = None, f"{type(e).__name__}: {e}", e
    outcomes = _all_gather_json({"result": result, "error": error}, device)
    failed = {r: o["error"] for r, o in enumerate(outcomes) if o["error"]}
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {detail}") from cause
    return [o["result"] for o in outcomes]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _notice(text: str) -> None:
    if world_from_env()[0] == 0:
        print(f"trainmesh: {text}", file=sys.stderr, flush=True)


# --- saving ------------------------------------------------------------------------------------------

def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _pieces(tensors: list[LocalTensor]) -> dict[str, tuple[dict, torch.Tensor]]:
    """This rank's pieces, by key: their description for the plan and a CPU copy of their data."""
    out = {}
    for t in tensors:
        flat, base = t.views[0].detach(), 0
        for box in t.boxes:
            n = box_numel(box)
            key = f"{t.name}@{','.join(map(str, box.offsets))}"
            data = flat[base:base + n].view(box.sizes).to("cpu", copy=True)
            out[key] = ({"key": key, "name": t.name, "shape": list(t.shape), "dtype": _dtype_name(flat.dtype),
                         "offsets": list(box.offsets), "sizes": list(box.sizes), "nbytes": n * flat.element_size()},
                        data)
            base += n
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
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()


def _write_rank_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    data = safetensors.torch.save(tensors)
    write_durably(path, data)
    return {"file": path.name, "sha256": sha256_hex(data), "bytes": len(data)}


def _content_hash(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return sha256_hex(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _manifest(run: Run, progress: TrainingProgress, plans: list[list[dict]], writers: dict[str, int],
              files: list[dict]) -> dict:
    tensors: dict[str, dict] = {}
    for rank, plan in enumerate(plans):
        for item in plan:
            if writers[item["key"]] != rank:
                continue
            entry = tensors.setdefault(item["name"], {"shape": item["shape"], "dtype": item["dtype"], "pieces": []})
            entry["pieces"].append({"key": item["key"], "file": files[rank]["file"], "offsets": item["offsets"],
                                    "sizes": item["sizes"]})
    scaler = run.engine.scaler
    cfg, mesh = run.cfg, run.mesh
    manifest = {
        "format": FORMAT, "version": VERSION, "step": progress.step, "progress": dataclasses.asdict(progress),
        "loss_scaler": {"scale": scaler.scale, "clean_steps": scaler.clean_steps,
                        "skipped_steps": scaler.skipped_steps},
        "model": dataclasses.asdict(cfg.model_config), "config": dataclasses.asdict(cfg),
        "layout": {"world_size": mesh.world_size, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "zero": cfg.zero},
        "tensors": dict(sorted(tensors.items())),
        "files": {f["file"]: {"sha256": f["sha256"], "bytes": f["bytes"]} for f in files},
    }
    manifest["sha256"] = _content_hash(manifest)
    return manifest


def _publish(tmp: Path, final: Path, manifest: dict) -> None:
    """Write the manifest, make the directory ``final`` in one rename, then point ``latest`` at it."""
    write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    replaced = final.with_name(f".replaced-{final.name}")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    replace_durably(final.parent / LATEST, f"{final.name}\n".encode())


def save(run: Run, progress: TrainingProgress) -> Path:
    """Save the training state after ``progress.step`` steps under ``--checkpoint-dir`` (a collective).

    A failure on any rank (a full disk, say) is raised on every rank, and the previous checkpoint stays
    the one ``latest`` names.
    """
    start = time.perf_counter()
    rank, device = world_from_env()[0], run.mesh.device
    final = step_dir(Path(run.cfg.checkpoint_dir), progress.step)
    tmp = final.with_name(f".tmp-{final.name}")
    mine = _pieces(local_state(run) + rng_state(rank, device))
    plans = _all_gather_json([item for item, _ in mine.values()], device)
    writers = assign_writers(plans)
    try:
        _on_every_rank(lambda: _fresh_dir(tmp) if rank == 0 else None, device, f"creating {tmp}")
        ours = {key: data for key, (_, data) in mine.items() if writers[key] == rank}
        files = _on_every_rank(lambda: _write_rank_file(tmp / f"rank-{rank:05d}.safetensors", ours), device,
                               f"writing the shards of {final}")
        manifest = _manifest(run, progress, plans, writers, files) if rank == 0 else {}
        _on_every_rank(lambda: _publish(tmp, final, manifest) if rank == 0 else None, device, f"publishing {final}")
    except CheckpointError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = next((p.name for p in candidates(final.parent)), None)
        raise CheckpointError(f"saving checkpoint {final} failed: {e}; the previous checkpoint "
                              f"({previous or 'none'}) is untouched and --resume will use it; free space in "
                              f"{final.parent} or choose another --checkpoint-dir") from e
    size = sum(f["bytes"] for f in files)
    _notice(f"saved {final} ({len(files)} files, {size / 2**20:.1f} MiB) in {time.perf_counter() - start:.2f} s")
    return final


def due(cfg: Config, steps_done: int) -> bool:
    """Whether to save after ``steps_done`` steps: every ``--checkpoint-every`` steps and at the end."""
    every = cfg.checkpoint_every
    return bool(cfg.checkpoint_dir) and ((every > 0 and steps_done % every == 0) or steps_done == cfg.steps)


# --- reading -----------------------------------------------------------------------------------------

def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory ``path``, checked against its own SHA-256 and for pieces that
    tile every tensor exactly; parsed as JSON only (nothing on disk is ever unpickled)."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} is not a finished checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): it was damaged or replaced") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} is not a trainmesh checkpoint manifest (format {FORMAT} version {VERSION})")
    if manifest.get("sha256") != _content_hash(manifest):
        raise CheckpointError(f"{file} does not match its own SHA-256: it was edited or corrupted after it was written")
    for name, entry in manifest["tensors"].items():
        boxes = [Box(torch.Size(p["offsets"]), torch.Size(p["sizes"])) for p in entry["pieces"]]
        if not _disjoint_cover(tuple(entry["shape"]), boxes) or any(p["file"] not in manifest["files"]
                                                                     for p in entry["pieces"]):
            raise CheckpointError(f"{file}: the pieces of {name} do not tile its shape {entry['shape']} exactly")
    return manifest


def _verified_tensors(path: Path, name: str, files: dict) -> dict[str, torch.Tensor]:
    """The tensors of file ``name`` of checkpoint ``path``, parsed only after its bytes proved sound."""
    try:
        data = read_verified(path / name, files[name]["sha256"], files[name]["bytes"])
        return safetensors.torch.load(data)
    except IntegrityError as e:
        raise CheckpointError(str(e)) from None
    except SafetensorError as e:
        raise CheckpointError(f"{path / name} matches its SHA-256 but is not a safetensors file ({e})") from None


def fill(wanted: list[LocalTensor], index: dict[str, dict], open_file: Callable[[str], dict[str, torch.Tensor]],
         source: Path) -> None:
    """Copy into each wanted tensor, box by box, its intersections with the pieces ``index`` lists, reading
    each file once; then write the result into every live view."""
    jobs: dict[str, list] = defaultdict(list)
    buffers = []
    for t in wanted:
        entry = index.get(t.name)
        if entry is None or tuple(entry["shape"]) != t.shape:
            there = "is missing" if entry is None else f"has shape {entry['shape']}"
            raise CheckpointMismatch(f"{source} holds a different model: {t.name} {there} there, shape "
                                     f"{list(t.shape)} here; use the --model it was written for, or another "
                                     f"--checkpoint-dir to start afresh")
        if entry["dtype"] not in DTYPES:
            raise CheckpointError(f"{source}: {t.name} is stored as {entry['dtype']}; trainmesh reads "
                                  f"{', '.join(DTYPES)}")
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
                raise CheckpointError(f"{source / name}: tensor {key} is missing or not the {dtype} of shape "
                                      f"{list(saved.sizes)} that the manifest lists")
            dst.copy_(region(src, common, saved))
    with torch.no_grad():
        for t, buf in buffers:
            for view in t.views:
                view.copy_(buf)


def _check_model(manifest: dict, cfg: Config, path: Path) -> None:
    there, name = manifest["model"], manifest["config"]["model"]
    differ = [f"{k} {there.get(k)} there, {v} here" for k, v in dataclasses.asdict(cfg.model_config).items()
              if there.get(k) != v]
    if differ:
        raise CheckpointMismatch(f"{path} holds a different model ({name}: {', '.join(differ)}); "
                                 f"resume with --model {name}, or choose another "
                                 f"--checkpoint-dir to start afresh")


def load(run: Run, path: Path) -> dict:
    """Read checkpoint ``path`` into this rank's part of ``run``, in ``run``'s own layout; returns the
    manifest. Only reads (no collective): :func:`resume` agrees across ranks, then :func:`_apply` finishes."""
    manifest = read_manifest(path)
    _check_model(manifest, run.cfg, path)
    rank, device = world_from_env()[0], run.mesh.device
    same_world = manifest["layout"]["world_size"] == run.mesh.world_size
    rng = rng_state(rank, device) if same_world else []
    fill(local_state(run) + rng, manifest["tensors"], lambda name: _verified_tensors(path, name, manifest["files"]),
         path)
    set_rng_state(rng, device)
    return manifest


def _apply(run: Run, manifest: dict) -> TrainingProgress:
    """The non-tensor state, and ZeRO stages 1-2's full parameters gathered from the loaded shards."""
    scaler = run.engine.scaler
    if scaler.enabled:
        for key, value in manifest["loss_scaler"].items():
            setattr(scaler, key, value)
    if isinstance(run.engine, zero.ZeroEngine):
        run.engine.after_update()
    return TrainingProgress(**manifest["progress"])


def _latest_name(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_DIR.fullmatch(name) else None


def candidates(root: Path) -> list[Path]:
    """Checkpoints to try, best first: the one ``latest`` names, then every other ``step-N``, newest first."""
    steps = sorted((p for p in root.iterdir() if STEP_DIR.fullmatch(p.name)), reverse=True) if root.is_dir() else []
    latest = _latest_name(root)
    return sorted(steps, key=lambda p: p.name != latest)


def resume(run: Run) -> TrainingProgress | None:
    """Load the newest sound checkpoint under ``--checkpoint-dir``; None if there is none (a collective).

    Every rank tries the same candidates in the same order; if any rank finds a file of one damaged, all
    of them move on to the next, and rank 0 says what it skipped. A checkpoint of another model is an
    error, not a reason to go back further.
    """
    start = time.perf_counter()
    root, device = Path(run.cfg.checkpoint_dir), run.mesh.device
    tried = []
    for path in candidates(root):
        try:
            manifest, error = load(run, path), None
        except CheckpointMismatch:
            raise
        except (CheckpointError, OSError) as e:
            manifest, error = None, str(e)
        errors = [e for e in _all_gather_json(error, device) if e]
        if not errors:
            progress = _apply(run, manifest)
            _notice(f"resumed from {path} (step {progress.step}) in {time.perf_counter() - start:.2f} s")
            return progress
        tried.append(f"{path.name}: {errors[0]}")
        _notice(f"checkpoint {path} is damaged ({errors[0]}); falling back to the previous complete checkpoint")
    if tried:
        raise CheckpointError(f"no sound checkpoint in {root}: " + "; ".join(tried))
    _notice(f"no checkpoint in {root} yet; starting at step 0")
    return None


def load_weights(run: Run, path: Path) -> None:
    """Start from the weights of a plain (unsharded) safetensors model file; every rank reads from it the
    parts it holds, so it works in any layout. The optimizer starts afresh."""
    try:
        full = safetensors.torch.load_file(path)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"--init-from {path}: not a readable safetensors file ({e}); write one with "
                              f"'trainmesh export CKPT --to FILE'") from None
    if sum(t.numel() for t in full.values()) != run.cfg.model_config.n_params():
        raise CheckpointMismatch(f"--init-from {path} holds {sum(t.numel() for t in full.values()):,} parameters, "
                                 f"--model {run.cfg.model} has {run.cfg.model_config.n_params():,}; use a file of "
                                 f"this model")
    index = {f"model/{k}": {"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                            "pieces": [{"key": k, "file": path.name, "offsets": [0] * t.dim(), "sizes": list(t.shape)}]}
             for k, t in full.items()}
    fill([t for t in local_state(run) if t.name.startswith("model/")], index, lambda _: full, path)
    if isinstance(run.engine, zero.ZeroEngine):
        run.engine.after_update()


def restore(run: Run) -> TrainingProgress:
    """Where training starts: the latest checkpoint with ``--resume`` (if there is one), else the weights of
    ``--init-from``, else step 0 as built."""
    cfg = run.cfg
    progress = resume(run) if cfg.resume else None
    if progress is not None and progress.step >= cfg.steps:
        raise CheckpointError(f"the checkpoint in {cfg.checkpoint_dir} is at step {progress.step}, which --steps "
                              f"{cfg.steps} has reached; pass a larger --steps to train further")
    if progress is None and cfg.init_from:
        load_weights(run, Path(cfg.init_from))
    return progress or TrainingProgress()


def check_resumable(cfg: Config) -> None:
    """Before spawning: a checkpoint of another model (or a missing ``--init-from``) is a one-line error."""
    if cfg.init_from and not Path(cfg.init_from).is_file():
        raise CheckpointError(f"--init-from {cfg.init_from} does not exist")
    if not cfg.resume:
        return
    for path in candidates(Path(cfg.checkpoint_dir)):
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        _check_model(manifest, cfg, path)
        return


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
    fill(wanted, manifest["tensors"], lambda name: _verified_tensors(path, name, manifest["files"]), path)
    return {t.name: t.views[0].view(t.shape) for t in wanted}


def export(source: Path, out: Path) -> str:
    """Write the weights of checkpoint ``source`` (a ``step-N`` directory, or a checkpoint directory: the
    one its ``latest`` names) to ``out`` as one plain safetensors file under the plain model's names."""
    path = source if (source / MANIFEST).exists() else next(iter(candidates(source)), source)
    manifest = read_manifest(path)
    tensors = {name.removeprefix("model/"): t for name, t in read_tensors(path, "model/").items()}
    replace_durably(out, safetensors.torch.save(tensors, metadata={"format": "pt", "step": str(manifest["step"]),
                                                                   "model": manifest["config"]["model"]}))
    n_params = sum(t.numel() for t in tensors.values())
    return f"wrote {len(tensors)} tensors ({n_params:,} parameters, step {manifest['step']}) of {path} to {out}"
