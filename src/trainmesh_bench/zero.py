"""``trainmesh bench zero``: each ZeRO stage against its PyTorch peer, and each stage's measured model
state against the paper's formula.

Peers: ``ZeroRedundancyOptimizer`` under DDP (stage 1), FSDP2 without reshard after forward (2), FSDP2 (3),
timed in pairs; memory as model state, in-step peak and RSS. Method: docs/performance.md."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._C._profiler import _EventType
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from trainmesh.tracking.metrics import optimizer_tensors, storage_bytes
from trainmesh.models.gpt import cross_entropy
from trainmesh.training.optim import build_adamw
from trainmesh.training.precision import dtype_of
from trainmesh.parallel.zero import default_units, model_state_bytes_formula
from trainmesh_bench.common import (RSS_STEPS, Bench, Result, Setup, StepFn, all_ranks, build, compare, fresh_model,
                                    init_mesh, rss_after, trainmesh_step)

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _adamw(bench: Bench, params) -> torch.optim.Optimizer:
    cfg = bench.cfg
    return build_adamw(params, bench.mesh.device, cfg.lr, cfg.betas, cfg.weight_decay)


def fsdp2_model(bench: Bench, reshard_after_forward: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model under ``fully_shard`` over the ``dp`` axis, unit by unit, then the root; without
    resharding after forward it keeps whole parameters from forward to backward, ZeRO-2's trade."""
    model = fresh_model(bench)
    dp_mesh = bench.mesh.device_mesh["dp"]
    for _, unit in default_units(model):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model, _adamw(bench, model.named_parameters())


def _zero_redundancy_step(bench: Bench) -> StepFn:
    """ZeRO-1's peer: DDP for the gradients, ``ZeroRedundancyOptimizer`` sharding AdamW's state."""
    cfg, group = bench.cfg, bench.mesh.group("dp")
    model = DistributedDataParallel(fresh_model(bench), bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True,
                                    process_group=group)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group,
                                        lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def step(i: int) -> None:
        micro = bench.micro_batches(i)
        for k, (x, y) in enumerate(micro):
            with model.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                (cross_entropy(model(x), y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def _fsdp2_step(bench: Bench, model: nn.Module, optimizer: torch.optim.Optimizer) -> StepFn:
    """The same step with FSDP2 and torch's own clipping; gradients kept (zeroed) between steps, as
    trainmesh keeps its gradient shards."""
    def step(i: int) -> None:
        micro = bench.micro_batches(i)
        for x, y in micro:
            (cross_entropy(model(x), y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), bench.cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def fsdp2_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state FSDP2 holds on this rank (the DTensors' local shards)."""
    params = list(model.parameters())
    tensors = [_local(p) for p in params] + [_local(p.grad) for p in params if p.grad is not None]
    return storage_bytes(tensors + [_local(t) for t in optimizer_tensors(optimizer)])


def allocated_peak(step: StepFn, i: int) -> int:
    """The most tensor memory allocated during ``step(i)`` above what was allocated when it began, from the
    profiler's allocation events (the allocator's running total), so trainmesh's and FSDP2's transient
    buffers count alike."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(i)
    events, allocations = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].total_allocated))
        events.extend(event.children)
    if not allocations:
        return 0
    allocations.sort()
    start = allocations[0][2] - allocations[0][1]
    return max(total for _, _, total in allocations) - start


@dataclass
class MemoryRow:
    """One stage's memory per rank: model state held after a step, the most model state held inside the
    next (ZeRO engines track it; plain DP holds the same all step), every tensor's in-step peak, and the
    paper's formula for the held state."""

    stage: int
    held: list[int]
    state_peak: list[int] | None
    tensor_peak: list[int]
    formula: float


def step_memory(step: StepFn, held: Callable[[], int], before_peak: Callable[[int], None] = lambda held: None
                ) -> tuple[int, int]:
    """(state held after ``step(0)``, held + the most allocated above it during ``step(1)``): the first step
    allocates the gradients and the optimizer's state, so the second starts from the state kept between
    steps. ``before_peak`` gets the held bytes just before the measured step."""
    step(0)
    now = held()
    before_peak(now)
    return now, now + allocated_peak(step, 1)


def trainmesh_memory(cfg: Setup, bench: Bench, step: StepFn) -> MemoryRow:
    """:func:`step_memory` of trainmesh's engine at ``bench.cfg.zero``, with the model state it peaked at."""
    engine, stage = bench.model.engine, bench.cfg.zero

    def track_peak(held: int) -> None:
        engine.peak_state_bytes = held

    held, tensor_peak = step_memory(step, lambda: storage_bytes(engine.state_tensors()),
                                    track_peak if stage else lambda held: None)
    state_peak = all_ranks(engine.peak_state_bytes) if stage else None
    if stage:
        engine.peak_state_bytes = None  # untracked while timed: each sample walks every state tensor
    formula = model_state_bytes_formula(cfg.model_config.n_params(), cfg.dp, stage, cfg.precision != "fp32",
                                        dtype_of(cfg.layout.grad_dtype).itemsize)
    return MemoryRow(stage, all_ranks(held), state_peak, all_ranks(tensor_peak), formula)


def _mb(values: list[int] | float) -> str:
    if isinstance(values, list):
        return "[" + ", ".join(f"{v / 2**20:.2f}" for v in values) + "] MiB"
    return f"{values / 2**20:.2f} MiB"


def _print_memory(cfg: Setup, rows: list[MemoryRow]) -> None:
    psi = cfg.model_config.n_params()
    print(f"  model state per rank vs ZeRO formula (fp32: 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N; "
          f"Ψ={psi:,}, N={cfg.dp}); in-step peaks of model state and of every tensor (activations too):")
    for row in rows:
        ratio = max(row.held) / row.formula
        print(f"    stage {row.stage}: held {_mb(row.held)}  formula {_mb(row.formula)}  ratio {ratio:.5f}  "
              f"in-step peak: model state {_mb(row.state_peak) if row.state_peak else 'as held'}, "
              f"all tensors {_mb(row.tensor_peak)}")


PEERS = {1: "torch ZeroRedundancyOptimizer + DDP", 2: "torch FSDP2 (no reshard after forward)",
         3: "torch FSDP2 fully_shard"}


def bench_zero(cfg: Setup, pairs: int) -> list[Result]:
    """Memory of stages 0-3 vs formula, then each stage vs its torch peer (throughput and peak RSS), and
    ZeRO-3's model state and trained parameters beside FSDP2's (after two steps and after the run; the
    expected size of that difference: docs/performance.md)."""
    if cfg.world < 2 or cfg.dp != cfg.world:
        raise SystemExit("trainmesh bench zero needs data parallel only, over at least 2 ranks: "
                         "pass --nproc N --dp N")
    mesh = init_mesh(cfg)
    bench = build(cfg.with_layout(zero=0), mesh)
    rows = [trainmesh_memory(cfg, bench, trainmesh_step(bench))]
    del bench
    gc.collect()
    tokens = cfg.global_batch * cfg.model_config.seq_len
    results, lines = [], []
    for stage, peer in PEERS.items():
        bench = build(cfg.with_layout(zero=stage), mesh)
        ours = trainmesh_step(bench)
        if stage == 1:
            peer_step = _zero_redundancy_step(bench)
        else:
            model, optimizer = fsdp2_model(bench, reshard_after_forward=stage == 3)
            peer_step = _fsdp2_step(bench, model, optimizer)
        rows.append(trainmesh_memory(cfg, bench, ours))
        if stage > 1:
            lines.append(_fsdp2_memory(stage, model, optimizer, peer_step))
        if stage == 3:
            early = _param_diff(bench, model)
        steps = {"trainmesh": ours, "torch": peer_step}
        rates = compare(steps, tokens, pairs, mesh.device, warmup=0)  # the memory steps warmed
        rss = rss_after(steps, pairs)
        results.append(Result(f"zero{stage}", f"trainmesh --zero {stage}", peer, rates["trainmesh"], rates["torch"],
                              rss["trainmesh"], rss["torch"]))
        if stage == 3:
            lines.append(_versus_fsdp2(bench, model, optimizer, early, 2 + pairs + RSS_STEPS))
        del bench, steps, ours, peer_step
        gc.collect()
    if dist.get_rank() == 0:
        print(f"bench zero: model={cfg.model} world={cfg.world} global_batch={cfg.global_batch} "
              f"microbatches={cfg.microbatches} device={mesh.device.type}")
        _print_memory(cfg, rows)
        print("\n".join([r.line() for r in results] + lines))
    return results


def _fsdp2_memory(stage: int, model: nn.Module, optimizer: torch.optim.Optimizer, step: StepFn) -> str:
    """FSDP2's held model state and in-step peak of every tensor, measured as trainmesh's are."""
    held, peak = step_memory(step, lambda: fsdp2_state_bytes(model, optimizer))
    mode = "fully_shard" if stage == 3 else "no reshard after forward"
    return (f"  fsdp2 ({mode}, zero{stage}'s peer): held {_mb(all_ranks(held))}  "
            f"in-step peak, all tensors {_mb(all_ranks(peak))}")


def _param_diff(bench: Bench, model: nn.Module) -> float:
    """The largest difference between ZeRO-3's parameters and FSDP2's (a collective)."""
    ours = bench.model.state_dict()
    theirs = {name: p.full_tensor() for name, p in model.named_parameters()}
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


def _versus_fsdp2(bench: Bench, model: nn.Module, optimizer: torch.optim.Optimizer, early: float, steps: int) -> str:
    """ZeRO-3's held model state and trained parameters beside FSDP2's after the same steps."""
    held = (all_ranks(storage_bytes(bench.model.engine.state_tensors())),
            all_ranks(fsdp2_state_bytes(model, optimizer)))
    return (f"  zero3 model_state_bytes {_mb(held[0])} vs fsdp2 {_mb(held[1])} "
            f"(ratio {max(held[0]) / max(held[1]):.3f}); max |param diff| after the same 2 steps: {early:.2e}, "
            f"after {steps}: {_param_diff(bench, model):.2e} (fp32 rounding amplified by training, as in float64)")
