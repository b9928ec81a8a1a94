r"""Sharded checkpoints: every rank writes only what it holds, and any layout can read them back.

Format. A checkpoint is a directory ``step-00000010`` under ``--checkpoint-dir`` holding one safetensors
file per rank and ``manifest.json``. Every tensor of the training state has a *global name* and the
*global shape* a single process would give it:

* ``model/<param>``: the weights under the plain model's names. Under mixed precision these are the fp32
  masters; the bf16/fp16 parameters are exactly those rounded (that is how every step makes them), so
  they are not stored and are rebuilt bit for bit on load;
* ``optim/<param>/exp_avg``, ``optim/<param>/exp_avg_sq``, ``optim/<param>/step``: AdamW's state;
* ``buffer/<layer>.router.expert_bias``: the routing bias of each MoE layer whose aux-loss-free update is
  on (``bias_rate``), training state that is not a weight (so not exported as one); every rank holding the
  layer holds it whole (the router is replicated over ep, tp and dp), so any layout reads it back;
* ``rng/<rank>/cpu`` (and ``cuda``): each rank's generator state, restored when the world size is the one
  that saved it (training itself draws nothing from these generators; in another layout there is no
  rank whose stream would continue).

For each tensor the manifest lists the pieces it was saved in: a box of the global tensor (offsets and
sizes per dimension, as in DCP's ``ChunkStorageMetadata``), the file and the key holding it. The step
(which fixes the data position, since batches are a function of ``(seed, step)``, and the learning rate),
the loss scale, the non-finite step counters, the config, the tokenizer (byte tokens, or a tokenizer file's
path and SHA-256, so that generation decodes with the same one) and every file's SHA-256 and length go there
too.

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

Trusting nothing read. Anyone who can write into ``--checkpoint-dir`` can also rewrite a manifest and its
hashes, so before any value of a manifest is used it is checked against a schema (:mod:`trainmesh.manifest`:
types, ranges, plain ``rank-N.safetensors`` file names, allowed dtypes, pieces tiling each tensor, sizes
within the files' bytes, the step matching its directory's name), every file it names is checked to be a
regular file inside the step directory with the recorded size before a byte of it is read
(:mod:`trainmesh.safe_io`), and each generator state is checked when it is applied. Any damage is one
line, ``checkpoint D/step-N is damaged: <file>: <what>``, and ``--resume`` goes back to an earlier
checkpoint of the same run, or stops.

Run identity. Every run has an id (a UUID) that its manifests record with a hash of its config. The
process that launches a run holds ``D/trainmesh.lock`` (:func:`claim`) for the run's life, so a second live
run on ``D`` is refused with the holder's pid; a fresh run refuses a ``D`` that holds another run's
checkpoints unless ``--overwrite`` (which deletes them first), ``--resume`` continues the id of the run it
resumes, and a fallback never loads a checkpoint of another run.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Box

from trainmesh import hf
from trainmesh.comm import log_all_gather
from trainmesh.config import Config
from trainmesh.data import data_tokenizer
from trainmesh.engine import Engine
from trainmesh.manifest import FORMAT, RUN_ID, VERSION, ManifestError, check_manifest, check_tiling, show
from trainmesh.mesh import Mesh, world_from_env
from trainmesh.models import config_from_dict, family, moe, preset, register_preset, spec_for, spec_of
from trainmesh.models.spec import HFIncompatible, ModelSpec
from trainmesh.precision import LossScaler
from trainmesh import runlock
from trainmesh.safe_io import (IntegrityError, check_regular, fsync_dir, inside, read_regular, read_verified,
                               replace_durably, sha256_hex, write_durably)
from trainmesh.expert_parallel import place_experts
from trainmesh.tensor_parallel import shard_boxes
from trainmesh.tokenizer import tokenizer_record

if TYPE_CHECKING:
    from trainmesh.run import Run

MANIFEST, LATEST, LOCK = "manifest.json", "latest", "trainmesh.lock"
STEP_DIR = re.compile(r"step-(\d{8})")
LEFTOVER = re.compile(r"\.(tmp|replaced)-step-\d{8}")
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


def local_state(model: nn.Module, engine: Engine) -> list[LocalTensor]:
    """Every tensor of training state this rank holds (its part of ``model`` and ``engine``'s optimizer),
    each placed in its global tensor."""
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
    return out + routing_state(model)


def routing_state(model: nn.Module) -> list[LocalTensor]:
    """The routing bias of every MoE layer of ``model`` that the aux-loss-free update moves: without it a
    resumed run would route as if the bias were back at 0. Layers without the update keep theirs at 0 and
    save nothing, so checkpoints written before biases were saved still load."""
    return [LocalTensor(f"buffer/{name}.router.expert_bias", tuple(layer.router.expert_bias.shape),
                        [whole(tuple(layer.router.expert_bias.shape))], [layer.router.expert_bias.view(-1)])
            for name, layer in moe.moe_layers(model) if layer.cfg.bias_rate]


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


# --- collectives without pickle ----------------------------------------------------------------------

def _all_gather_json(obj: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in rank order, as JSON bytes in tensors (``all_gather_object`` would unpickle)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    lengths = log_all_gather(torch.tensor([data.numel()], device=device)).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    rows = log_all_gather(padded).cpu()
    return [json.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def on_every_rank(action: Callable[[], Any], device: torch.device, what: str) -> list[Any]:
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


def config_hash(cfg: Config) -> str:
    return sha256_hex(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())


def _content_hash(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return sha256_hex(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def model_source(cfg: Config) -> str:
    """How runs, summaries and reports name the model of a ``trainmesh train`` run: its preset, or for an
    ``--init-hf`` import the architecture and the directory it came from (``LlamaForCausalLM from DIR``)."""
    if not cfg.init_hf:
        return cfg.model
    architecture = spec_of(cfg.model).hf.architecture
    return f"{architecture} from {cfg.init_hf}"


def describe(cfg: Config, mesh: Mesh) -> dict:
    """What a manifest records of a ``trainmesh train`` run besides its tensors: the model (its family, its
    config and where it came from), the config and its hash, the layout, the tokenizer file (recorded with
    its hash when the manifest is written, :func:`trainmesh.tokenizer.tokenizer_record`)."""
    return {"config_sha256": config_hash(cfg), "model": dataclasses.asdict(cfg.model_config),
            "model_source": {"family": spec_of(cfg.model).family, "source": model_source(cfg)},
            "config": dataclasses.asdict(cfg), "tokenizer": data_tokenizer(cfg.data, cfg.tokenizer),
            "layout": {"world_size": mesh.world_size, "dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp, "pp": cfg.pp,
                       "ep": cfg.ep, "zero": cfg.zero}}


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
    like = next(iter({**spec.presets, **spec.planner_presets}.values()))
    return spec, config_from_dict(like, manifest["model"])


def recorded_weights(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The full weights (and routing buffers, under ``buffer/`` names' tails) of checkpoint ``path`` under
    the names of its trainmesh family's model, translated from Hugging Face's names where a script saved a
    model held in HF's classes."""
    spec, cfg = recorded_model(manifest, path)
    tensors = {name.split("/", 1)[1]: t for prefix in ("model/", "buffer/")
               for name, t in read_tensors(path, prefix).items()}
    if "hf_config" not in manifest.get("model_source", {}):
        return tensors
    try:
        return hf.to_trainmesh(spec, cfg, tensors, str(path))
    except hf.HFError as e:
        raise CheckpointError(str(e)) from None


def source_name(manifest: dict) -> str:
    """How a checkpoint's model is named to a person."""
    return manifest.get("model_source", {}).get("source") or manifest["config"].get("model") or "model"


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
        "run": {"id": progress.run_id, "config_sha256": description["config_sha256"]},
        "loss_scaler": {"scale": scaler.scale, "clean_steps": scaler.clean_steps,
                        "skipped_steps": scaler.skipped_steps},
        "model": description["model"], "model_source": description["model_source"],
        "config": description["config"], "layout": description["layout"],
        **({"tokenizer": tokenizer_record(description["tokenizer"])} if "tokenizer" in description else {}),
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
    """Save the training state after ``progress.step`` steps under ``--checkpoint-dir`` (a collective)."""
    return save_state(run.model, run.engine, run.mesh, Path(run.cfg.checkpoint_dir), progress,
                      describe(run.cfg, run.mesh))


def save_state(model: nn.Module, engine: Engine, mesh: Mesh, root: Path, progress: TrainingProgress,
               description: dict) -> Path:
    """Save this rank's part of ``model`` and ``engine``'s optimizer after ``progress.step`` steps as
    ``root/step-N`` (a collective); ``description`` (:func:`describe`) goes into the manifest.

    A failure on any rank (a full disk, say) is raised on every rank, and the previous checkpoint stays
    the one ``latest`` names.
    """
    start = time.perf_counter()
    rank, device = world_from_env()[0], mesh.device
    if not progress.run_id:
        progress = dataclasses.replace(progress, run_id=agreed_run_id(device))
    final = step_dir(root, progress.step)
    tmp = final.with_name(f".tmp-{final.name}")
    mine = _pieces(local_state(model, engine) + rng_state(rank, device))
    plans = _all_gather_json([item for item, _ in mine.values()], device)
    writers = assign_writers(plans)
    try:
        on_every_rank(lambda: _fresh_dir(tmp) if rank == 0 else None, device, f"creating {tmp}")
        ours = {key: data for key, (_, data) in mine.items() if writers[key] == rank}
        files = on_every_rank(lambda: _write_rank_file(tmp / f"rank-{rank:05d}.safetensors", ours), device,
                               f"writing the shards of {final}")
        on_every_rank(lambda: _publish(tmp, final, _manifest(description, engine.scaler, progress, plans, writers,
                                                              files)) if rank == 0 else None,
                       device, f"publishing {final}")
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
    SHA-256 and inside the schema (:mod:`trainmesh.manifest`); its files are not looked at (nor, since that
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
    if manifest.get("sha256") != _content_hash(manifest):
        raise CheckpointDamaged(path, f"{file} does not match its own SHA-256: it was edited or corrupted after "
                                      f"it was written")
    try:
        check_manifest(manifest, path.resolve().name)
    except ManifestError as e:
        raise CheckpointDamaged(path, f"{file}: {e}") from None
    return manifest


def _verified_tensors(path: Path, name: str, files: dict) -> dict[str, torch.Tensor]:
    """The tensors of file ``name`` of checkpoint ``path``, parsed only after its bytes proved sound."""
    try:
        data = read_verified(inside(path, name), files[name]["sha256"], files[name]["bytes"])
        return safetensors.torch.load(data)
    except IntegrityError as e:
        raise CheckpointDamaged(path, str(e)) from None
    except SafetensorError as e:
        raise CheckpointDamaged(path, f"{path / name} matches its SHA-256 but is not a safetensors file "
                                      f"({e})") from None


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


def _check_model(manifest: dict, cfg: Config, path: Path) -> None:
    there, name = manifest["model"], source_name(manifest)
    differ = [f"{k} {there.get(k)} there, {v} here" for k, v in dataclasses.asdict(cfg.model_config).items()
              if there.get(k) != v]
    if len(differ) == 1 and differ[0].startswith("vocab_size "):
        raise CheckpointMismatch(f"{path} holds a model with vocabulary {there.get('vocab_size')}, and this run's "
                                 f"tokenizer/data gives {cfg.model_config.vocab_size} (padded for tp={cfg.tp}); "
                                 f"pass the tokenizer and data the checkpoint was trained with "
                                 f"(--tokenizer {manifest['config'].get('tokenizer') or '(bytes)'})")
    if differ:
        raise CheckpointMismatch(f"{path} holds a different model ({name}: {', '.join(differ)}); "
                                 f"resume without --model/--init-hf to continue it, or choose another "
                                 f"--checkpoint-dir to start afresh")


def _apply_rng(rng: list[LocalTensor], manifest: dict, path: Path, device: torch.device) -> None:
    for t in rng:
        try:
            set_rng_state([t], device)
        except RuntimeError as e:
            file = path / manifest["tensors"][t.name]["pieces"][0]["file"]
            raise CheckpointDamaged(path, f"{file}: {t.name} is not a valid generator state ({e})") from None


def load(run: Run, path: Path, run_id: str | None = None) -> dict:
    """Read checkpoint ``path`` into this rank's part of ``run``, in ``run``'s own layout; returns the
    manifest. A checkpoint of a run other than ``run_id`` (if given) is refused before anything is loaded.
    Only reads (no collective): :func:`resume` agrees across ranks, then :func:`apply_loaded` finishes."""
    manifest = read_manifest(path)
    if run_id and manifest["run"]["id"] != run_id:
        raise CheckpointOfAnotherRun(f"checkpoint {path} belongs to run {manifest['run']['id']}, not to run "
                                     f"{run_id} that is being resumed; it is not used")
    _check_model(manifest, run.cfg, path)
    load_state(run.model, run.engine, run.mesh, path, manifest)
    return manifest


def load_state(model: nn.Module, engine: Engine, mesh: Mesh, path: Path, manifest: dict) -> None:
    """Read checkpoint ``path`` (whose sound ``manifest`` is given) into this rank's part of ``model`` and
    ``engine``'s optimizer, in their own layout (no collective): resharding is the boxes this layout holds
    intersected with those the checkpoint's layout saved. Generator states are restored in the same world."""
    rank, device = world_from_env()[0], mesh.device
    same_world = manifest["layout"]["world_size"] == mesh.world_size
    rng = rng_state(rank, device) if same_world else []
    index, open_file = manifest["tensors"], lambda name: _verified_tensors(path, name, manifest["files"])
    if "hf_config" in manifest.get("model_source", {}) and not _holds_names_of(model, manifest):
        index, open_file = _in_family_names(path, manifest)
    try:
        fill(local_state(model, engine) + rng, index, open_file, path,
             lambda what: CheckpointDamaged(path, f"{path / MANIFEST} lists the model this run has, but {what}"))
    except OSError as e:  # reading a file that passed every check failed (permissions, an I/O error)
        raise CheckpointDamaged(path, str(e)) from None
    _apply_rng(rng, manifest, path, device)


def _holds_names_of(model: nn.Module, manifest: dict) -> bool:
    """Whether ``model``'s parameters are named as the checkpoint's (a model held in Hugging Face's classes
    loading a checkpoint of one, as a script does) rather than as its trainmesh family's."""
    return all(f"model/{name}" in manifest["tensors"] for name, _ in model.named_parameters())


def _in_family_names(path: Path, manifest: dict) -> tuple[dict, Callable[[str], dict[str, torch.Tensor]]]:
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
    index = {name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                    "pieces": [{"key": name, "file": "translated", "offsets": [0] * t.dim(), "sizes": list(t.shape)}]}
             for name, t in out.items()}
    return index, lambda _: out


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
    """Load the newest sound checkpoint of this run under ``--checkpoint-dir``; None if there is none (a
    collective).

    The run is the one ``TRAINMESH_RUN_ID`` names (set by :func:`claim`), else :func:`run_to_continue`'s.
    Every rank tries the same candidates in the same order; if any rank finds a file of one damaged (or the
    checkpoint is another run's), all of them move on to the next, and rank 0 says what it skipped. A
    checkpoint of another model is an error, not a reason to go back further.
    """
    start = time.perf_counter()
    root, device = Path(run.cfg.checkpoint_dir), run.mesh.device
    run_id = os.environ.get(RUN_ID_ENV) or run_to_continue(root)
    paths = candidates(root)
    tried = []
    for i, path in enumerate(paths):
        try:
            manifest, error = load(run, path, run_id), None
        except CheckpointMismatch:
            raise
        except CheckpointError as e:
            manifest, error = None, str(e)
        except OSError as e:
            manifest, error = None, str(CheckpointDamaged(path, str(e)))
        errors = [e for e in _all_gather_json(error, device) if e]
        if not errors:
            progress = apply_loaded(run.engine, manifest)
            _notice(f"resumed from {path} (step {progress.step}) in {time.perf_counter() - start:.2f} s")
            return progress
        tried.append(errors[0])
        then = "falling back to the previous complete checkpoint" if i + 1 < len(paths) else "none is left to try"
        _notice(f"{errors[0]}; {then}")
    if tried:
        raise CheckpointError(f"no sound checkpoint of run {run_id} in {root}: " + "; ".join(tried))
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
    load_full(run, full, f"--init-from {path}")


def load_hf_weights(run: Run, path: Path) -> None:
    """Start from the weights of a local Hugging Face directory (``--init-hf``), converted to our names by
    the family's mapping (:mod:`trainmesh.hf`) and resharded like ``--init-from``'s."""
    try:
        full = hf.read_hf(path)[2]
    except hf.HFError as e:
        raise CheckpointError(f"--init-hf: {e}") from None
    load_full(run, full, f"--init-hf {path}")


def load_full(run: Run, full: dict[str, torch.Tensor], source: str) -> None:
    """Copy into this rank's part of ``run`` (in any layout) the parts it holds of the full weights ``full``,
    under the plain model's names; ``source`` names where they came from in errors."""
    n_params = sum(t.numel() for t in full.values())
    if n_params != run.cfg.model_config.n_params():
        raise CheckpointMismatch(f"{source} holds {n_params:,} parameters, --model {run.cfg.model} has "
                                 f"{run.cfg.model_config.n_params():,}; use weights of this model")
    index = {f"model/{k}": {"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
                            "pieces": [{"key": k, "file": "weights", "offsets": [0] * t.dim(), "sizes": list(t.shape)}]}
             for k, t in full.items()}
    fill([t for t in local_state(run.model, run.engine) if t.name.startswith("model/")], index, lambda _: full, Path(source),
         lambda what: CheckpointMismatch(f"{source} holds a different model: {what}; use weights of "
                                         f"--model {run.cfg.model}"))
    run.engine.after_update()


def agreed_run_id(device: torch.device) -> str:
    """``TRAINMESH_RUN_ID`` if the launching process set it, else a new id rank 0 draws (a collective)."""
    return _all_gather_json(os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex, device)[0]


def start_fresh(cfg: Config) -> None:
    """Make ``--checkpoint-dir`` ready for a fresh run: a directory holding checkpoints (of another run) is
    refused, or with ``--overwrite`` emptied of them first (step directories, leftovers of interrupted
    saves and the ``latest`` pointer), so no step of the other run survives to be resumed or fallen back to."""
    root = Path(cfg.checkpoint_dir)
    existing = candidates(root)
    if not existing:
        return
    if not cfg.overwrite:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise CheckpointError(f"{root} holds checkpoints of another run ({existing[0].name}{more}, run "
                              f"{run_to_continue(root) or 'unknown'}); pass --resume to continue that run, "
                              f"--overwrite to delete them and start afresh, or choose another --checkpoint-dir")
    for p in root.iterdir():
        if STEP_DIR.fullmatch(p.name) or LEFTOVER.fullmatch(p.name):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    (root / LATEST).unlink(missing_ok=True)
    fsync_dir(root)


def restore(run: Run) -> TrainingProgress:
    """Where training starts: the latest checkpoint of this run with ``--resume`` (if there is one), else
    the weights of ``--init-from``, else step 0 as built; a fresh run first makes ``--checkpoint-dir`` its
    own (:func:`start_fresh`). The progress returned carries the run's id, which every save records."""
    cfg, device = run.cfg, run.mesh.device
    progress = resume(run) if cfg.resume else None
    if progress is not None and progress.step >= cfg.steps:
        raise CheckpointError(f"the checkpoint in {cfg.checkpoint_dir} is at step {progress.step}, which --steps "
                              f"{cfg.steps} has reached; pass a larger --steps to train further")
    if progress is not None:
        return progress
    if cfg.checkpoint_dir and not cfg.resume:
        rank = world_from_env()[0]
        on_every_rank(lambda: start_fresh(cfg) if rank == 0 else None, device,
                       f"starting a fresh run in {cfg.checkpoint_dir}")
    if cfg.init_from:
        load_weights(run, Path(cfg.init_from))
    if cfg.init_hf:
        load_hf_weights(run, Path(cfg.init_hf))
    return TrainingProgress(run_id=agreed_run_id(device))


@contextlib.contextmanager
def claim(cfg: Config) -> Iterator[str]:
    """Hold ``--checkpoint-dir`` for the life of this run (``trainmesh.lock`` in it, by the process that
    launches the ranks) and decide the run's id: the id of the run ``--resume`` continues, else a new one
    for a fresh run (after :func:`start_fresh`). The ranks this process starts inherit the id in
    ``TRAINMESH_RUN_ID``. A directory that another live run holds is an error naming that run's pid."""
    if not cfg.checkpoint_dir:
        yield ""
        return
    root = Path(cfg.checkpoint_dir)
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
        run_id = run_to_continue(root) if cfg.resume else None
        if run_id is None:
            if not cfg.resume:
                start_fresh(cfg)
            run_id = uuid.uuid4().hex
        lock.note(run_id=run_id)
        os.environ[RUN_ID_ENV] = run_id
        yield run_id


MODEL_SETTINGS = ("tokenizer", "moe_experts", "moe_top_k", "moe_dropless", "moe_capacity", "moe_aux_coef",
                  "moe_z_coef", "moe_bias_rate")
"""The settings besides ``model`` that shape a ``trainmesh train`` run's model."""


def model_settings(root: Path, given: Collection[str]) -> dict[str, Any]:
    """What ``--resume`` without ``--model``/``--init-hf`` takes from the newest sound checkpoint in ``root``:
    its model, registered as a preset named by its source (``LlamaForCausalLM from DIR``, a model a script
    saved), so the run needs neither the preset nor the directory it first came from; and the recorded
    settings that shaped it, except those in ``given`` (set on the command line). Empty without one."""
    for path in candidates(root):
        try:
            manifest = read_manifest(path)
            spec, cfg = recorded_model(manifest, path)
        except CheckpointError:
            continue
        name = source_name(manifest)
        register_preset(spec, name, cfg)
        recorded = manifest["config"]
        settings = {k: recorded[k] for k in MODEL_SETTINGS if k in recorded and k not in given}
        return {**settings, "model": name, "init_hf": "", **({} if "seq_len" in given else {"seq_len": 0})}
    return {}


def check_resumable(cfg: Config) -> None:
    """Before spawning: a checkpoint of another model (or a missing ``--init-from``, an ``--init-hf``
    directory whose weights do not fit its config) is a one-line error."""
    if cfg.init_from and not Path(cfg.init_from).is_file():
        raise CheckpointError(f"--init-from {cfg.init_from} does not exist")
    if cfg.init_hf:
        try:
            hf.check_weights(cfg.init_hf)
        except hf.HFError as e:
            raise CheckpointError(f"--init-hf: {e}") from None
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
    fill(wanted, manifest["tensors"], lambda name: _verified_tensors(path, name, manifest["files"]), path,
         lambda what: CheckpointDamaged(path, what))
    return {t.name: t.views[0].view(t.shape) for t in wanted}


def _step_to_export(source: Path) -> Path:
    """``source`` if it is a ``step-N`` directory, else the checkpoint its ``latest`` names (or its newest)."""
    return source if (source / MANIFEST).exists() else next(iter(candidates(source)), source)


def export(source: Path, out: Path) -> str:
    """Write the weights of checkpoint ``source`` (a ``step-N`` directory, or a checkpoint directory: the
    one its ``latest`` names) to ``out`` as one plain safetensors file under the plain model's names."""
    path = _step_to_export(source)
    manifest = read_manifest(path)
    tensors = {name.removeprefix("model/"): t for name, t in read_tensors(path, "model/").items()}
    replace_durably(out, safetensors.torch.save(tensors, metadata={"format": "pt", "step": str(manifest["step"]),
                                                                   "model": source_name(manifest)}))
    n_params = sum(t.numel() for t in tensors.values())
    return f"wrote {len(tensors)} tensors ({n_params:,} parameters, step {manifest['step']}) of {path} to {out}"


def export_hf(source: Path, out: Path) -> str:
    """Write the weights of checkpoint ``source`` (as for :func:`export`) to directory ``out`` as the
    family's Hugging Face model (``config.json`` and ``model.safetensors``, :func:`trainmesh.hf.save_hf`), the
    shape taken from the manifest, so ``AutoModelForCausalLM.from_pretrained(out)`` loads it."""
    path = _step_to_export(source)
    manifest = read_manifest(path)
    spec, model_config = recorded_model(manifest, path)
    tensors = recorded_weights(path, manifest)  # a routing bias moved in training is refused by the mapping
    try:
        hf.save_hf(tensors, out, model_config)
    except hf.HFError as e:
        raise CheckpointError(f"export --hf: {e}") from None
    return (f"wrote {spec.hf.architecture} ({sum(t.numel() for t in tensors.values()):,} parameters, step "
            f"{manifest['step']}) of {path} to {out}")
