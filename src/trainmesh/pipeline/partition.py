"""Cut a model into pipeline stages of whole layers, and put the stages back together for export. A stage is the plain
model with the layers it does not own deleted, so names stay the plain model's (as torchtitan); global stage s of
``p * v`` runs on rank ``s % p``."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.distributed.comm import Comm
from trainmesh.pipeline.schedules import rank_stages
from trainmesh.training.optim import TIED_PEER

AXIS = "pp"


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _layer_keys(model: nn.Module) -> list[str]:
    return sorted(model.blocks.keys(), key=int)


def balanced_partition(layer_sizes: Sequence[int], n_stages: int, first_extra: int = 0,
                       last_extra: int = 0) -> list[range]:
    """Contiguous layers per stage, at least one each, minimising the largest stage's parameter count with
    ``first_extra``/``last_extra`` on the end stages; exact by dynamic programming in O(stages · layers²)."""
    n = len(layer_sizes)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} stages of at least one layer; "
                         f"use at most {n} stages (pp * virtual stages)")
    prefix = [0]
    for size in layer_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, start: int, stop: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == n_stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra

    # best[k][j]: smallest possible largest stage when stages 0..k hold layers 0..j-1; cut[k][j]: start of k.
    best = [[float("inf")] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, n_stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                candidate = max(best[k - 1][i], cost(k, i, j))
                if candidate < best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    stops = [n]
    for k in range(n_stages - 1, 0, -1):
        stops.append(cut[k][stops[-1]])
    starts = [0, *reversed(stops[1:])]
    return [range(a, b) for a, b in zip(starts, reversed(stops))]


def explicit_partition(layers_per_stage: Sequence[int], n_layers: int) -> list[range]:
    """Ranges for given layer counts per stage, in model order (e.g. ``(1, 3)``: layer 0, layers 1-3)."""
    if any(c < 1 for c in layers_per_stage) or sum(layers_per_stage) != n_layers:
        raise ValueError(f"layers per stage {list(layers_per_stage)} must be >= 1 each and sum to the model's "
                         f"{n_layers} layers")
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def partition_model(model: nn.Module, n_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """Layers of each global stage: as given, else balanced by parameter count (:func:`balanced_partition`)."""
    keys = _layer_keys(model)
    if layers_per_stage:
        if len(layers_per_stage) != n_stages:
            raise ValueError(f"got layer counts for {len(layers_per_stage)} stages, the pipeline has {n_stages} "
                             f"(pp * virtual stages); give one count per stage")
        return explicit_partition(layers_per_stage, len(keys))
    sizes = [_numel(model.blocks[k]) for k in keys]
    return balanced_partition(sizes, n_stages, _numel(model.embed), _numel(model.ln_f) + _numel(model.head))


def _hollow_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with no embedding, layers, norm or head (so nothing large is copied)."""
    parts = model.embed, model.blocks, model.ln_f, model.head
    model.embed = model.ln_f = model.head = None
    model.blocks = nn.ModuleDict()
    try:
        return copy.deepcopy(model)
    finally:
        model.embed, model.blocks, model.ln_f, model.head = parts


def _keep(target: nn.Module, source: nn.Module, layers: Sequence[int], first: bool, last: bool) -> None:
    """Give ``target`` the listed layers of ``source`` (the same modules, not copies) and its ends."""
    target.embed = source.embed if first else None
    target.blocks = nn.ModuleDict({str(i): source.blocks[str(i)] for i in layers})
    target.ln_f = source.ln_f if last else None
    target.head = source.head if last else None


def split_model(model: nn.Module, layers: Sequence[range], rank: int, n_ranks: int,
                n_virtual: int = 1) -> tuple[nn.Module, dict[int, nn.Module]]:
    """Cut ``model`` in place to what pipeline ``rank`` holds; returns ``(part, chunks)``: the model the engine
    optimises, and each global stage's module (``part``, or hollow copies sharing its modules: with ``v`` chunks, or
    where ``part`` also names its tied head ``embed``)."""
    n_total = n_ranks * n_virtual
    if len(layers) != n_total:
        raise ValueError(f"got {len(layers)} layer ranges for {n_total} stages (pp * virtual stages)")
    stages = rank_stages(rank, n_ranks, n_virtual)
    owned = [i for s in stages for i in layers[s]]
    first, last = 0 in stages, n_total - 1 in stages
    tied = _tied_weights(model) if first or last else []
    for p in tied:  # the first and last stage are on different ranks (global stage s runs on rank s % p)
        setattr(p, TIED_PEER, n_ranks - 1 if first else 0)
    _keep(model, model, owned, first=first, last=last)
    if n_virtual == 1 and not (tied and last):
        return model, {stages[0]: model}
    chunks = {}
    for s in stages:
        chunk = _hollow_copy(model)
        _keep(chunk, model, layers[s], first=s == 0, last=s == n_total - 1)
        chunks[s] = chunk
    if tied and last:  # the part the engine holds names the tied weight as the embedding's, as one process does
        model.embed = model.head
    return model, chunks


def _tied_weights(model: nn.Module) -> list[nn.Parameter]:
    """The head's parameters that are the embedding's too (a tied output head), which both end stages hold."""
    embedding = {id(p) for p in model.embed.parameters()} if model.embed is not None else set()
    return [p for p in model.head.parameters() if id(p) in embedding] if model.head is not None else []


def gather_stages(state: dict[str, torch.Tensor], comm: Comm) -> dict[str, torch.Tensor]:
    """Every pipeline rank's state dict merged, on every pipeline rank (a collective over ``pp``): tensors
    broadcast from their owner (``pp/state_gather``), giving the plain model's full state dict."""
    group = comm.mesh.group(AXIS)
    metas: list = [None] * comm.mesh.size(AXIS)
    dist.all_gather_object(metas, [(k, v.shape, v.dtype) for k, v in state.items()], group=group)
    merged: dict[str, torch.Tensor] = {}
    for src, meta in enumerate(metas):
        for key, shape, dtype in meta:
            mine = src == comm.mesh.rank(AXIS)
            tensor = state[key].contiguous() if mine else torch.empty(shape, dtype=dtype, device=comm.mesh.device)
            comm.broadcast(tensor, AXIS, src=src, op="state_gather")
            merged[key] = tensor
    return merged
