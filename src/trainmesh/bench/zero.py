"""``trainmesh bench zero``: trainmesh ZeRO-3 against PyTorch FSDP2 (``fully_shard``), and each ZeRO
stage's measured model state against the paper's formula.

Both implementations train the same GPT from the same seed on the same batches and ranks, with the same
wrapping (:func:`trainmesh.zero.default_units`: embeddings, each block, final norm, head, each resharded
after forward) and gradients reduce-scattered every micro-batch; timed rounds alternate
(:func:`trainmesh.bench.common.compare`). Memory per rank is reported two ways:

* ``model_state_bytes``: parameters + gradients + optimizer state held after a step, counted as
  ``metrics.jsonl`` counts it (for FSDP2, the local shards of its DTensors); trainmesh also reports the
  most it held at any point inside a step.
* peak RSS over a few further untimed steps of each (Linux: :func:`peak_rss`). Both models live in the
  one process, so both figures include the other's resident state; their difference is what each one
  allocates transiently.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trainmesh.bench.common import StepFn, compare
from trainmesh.comm import log_all_gather
from trainmesh.config import Config
from trainmesh.mesh import Mesh
from trainmesh.metrics import optimizer_tensors, storage_bytes
from trainmesh.models.gpt import GPT, cross_entropy
from trainmesh.optim import build_adamw
from trainmesh.precision import dtype_of
from trainmesh.run import Run
from trainmesh.train import build, forward_backward, full_state_dict, rank_batch, setup_process
from trainmesh.zero import default_units, model_state_bytes_formula

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
RSS_STEPS = 3
MemoryRow = tuple[int, list[int], list[int] | None, float]


def peak_rss(step: StepFn, first: int, count: int) -> int:
    """Peak resident bytes over ``count`` steps. Before each step the heap's free memory is handed back
    to the OS (glibc ``malloc_trim``) and the kernel's high-water mark is reset (Linux ``clear_refs``), so
    the figure is what is resident during this implementation's steps, not what earlier work left behind."""
    libc = ctypes.CDLL(None)
    peak = 0
    for i in range(first, first + count):
        gc.collect()
        libc.malloc_trim(0)
        CLEAR_REFS.write_text("5")
        step(i)
        line = next(x for x in STATUS.read_text().splitlines() if x.startswith("VmHWM:"))
        peak = max(peak, int(line.split()[1]) * 1024)
    return peak


def trainmesh_step(run: Run) -> StepFn:
    def step(i: int) -> None:
        forward_backward(run, rank_batch(run, run.data.train, i, run.cfg.global_batch))
        run.engine.step(run.cfg.lr, run.cfg.grad_clip)

    return step


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def fsdp2_model(run: Run) -> tuple[GPT, torch.optim.Optimizer]:
    """The same GPT under ``fully_shard`` over the ``dp`` axis, unit by unit, then the root."""
    cfg, device = run.cfg, run.mesh.device
    model = GPT(cfg.model_config, seed=cfg.seed).to(device)
    dp_mesh = run.mesh.device_mesh["dp"]
    for _, unit in default_units(model):
        fully_shard(unit, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, build_adamw(model.named_parameters(), device, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)


def _fsdp2_step(run: Run, model: GPT, optimizer: torch.optim.Optimizer) -> StepFn:
    """The same step with FSDP2 and torch's own clipping; gradients kept (zeroed) between steps, as
    trainmesh keeps its gradient shards."""
    def step(i: int) -> None:
        micro = rank_batch(run, run.data.train, i, run.cfg.global_batch)
        for x, y in micro:
            (cross_entropy(model(x), y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def fsdp2_state_bytes(model: GPT, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state FSDP2 holds on this rank (the DTensors' local shards)."""
    params = list(model.parameters())
    tensors = [_local(p) for p in params] + [_local(p.grad) for p in params if p.grad is not None]
    return storage_bytes(tensors + [_local(t) for t in optimizer_tensors(optimizer)])


def _per_rank(value: int) -> list[int]:
    return log_all_gather(torch.tensor([value], dtype=torch.int64)).reshape(-1).tolist()


def stage_memory(cfg: Config, mesh: Mesh, steps: int = 2) -> list[MemoryRow]:
    """(stage, model_state_bytes per rank after ``steps`` steps, in-step peak per rank (ZeRO engines
    track it; plain DP holds the same all step), formula)."""
    psi = cfg.model_config.n_params()
    rows = []
    for stage in (0, 1, 2, 3):
        run = build(dataclasses.replace(cfg, zero=stage), mesh)
        step = trainmesh_step(run)
        for i in range(steps):
            step(i)
        held = storage_bytes(run.engine.state_tensors())
        peak = _per_rank(run.engine.peak_state_bytes) if stage else None
        formula = model_state_bytes_formula(psi, cfg.dp, stage, cfg.precision != "fp32",
                                            dtype_of(cfg.grad_dtype).itemsize)
        rows.append((stage, _per_rank(held), peak, formula))
        del run, step
        gc.collect()
    return rows


def _mb(values: list[int] | float) -> str:
    if isinstance(values, list):
        return "[" + ", ".join(f"{v / 2**20:.2f}" for v in values) + "] MiB"
    return f"{values / 2**20:.2f} MiB"


def _print_memory(cfg: Config, rows: list[MemoryRow]) -> None:
    psi = cfg.model_config.n_params()
    print(f"  model state per rank vs ZeRO formula (fp32: 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N; "
          f"Ψ={psi:,}, N={cfg.dp}):")
    for stage, held, peak, formula in rows:
        ratio = max(held) / formula
        print(f"    stage {stage}: measured {_mb(held)}  formula {_mb(formula)}  ratio {ratio:.5f}  "
              f"in-step peak {_mb(peak) if peak else 'as held'}")


def bench_zero(cfg: Config, rounds: int, steps_per_round: int) -> dict[str, float]:
    """Memory of stages 0-3 vs formula, then trainmesh ``--zero 3`` vs FSDP2 (throughput and memory)."""
    if cfg.world_size < 2 or cfg.dp != cfg.world_size:
        raise SystemExit("trainmesh bench zero needs data parallel only, over at least 2 ranks: "
                         "pass --nproc N --dp N")
    cfg = dataclasses.replace(cfg, zero=3)
    mesh = setup_process(cfg)
    rows = stage_memory(cfg, mesh)
    run = build(cfg, mesh)
    model, optimizer = fsdp2_model(run)
    steps = {"trainmesh": trainmesh_step(run), "fsdp2": _fsdp2_step(run, model, optimizer)}
    rates = compare(steps, cfg.global_batch * cfg.model_config.seq_len, rounds, steps_per_round, mesh.device)
    held = {"trainmesh": _per_rank(storage_bytes(run.engine.state_tensors())),
            "fsdp2": _per_rank(fsdp2_state_bytes(model, optimizer))}
    after_timed = 2 + rounds * steps_per_round
    rss = {name: _per_rank(peak_rss(step, after_timed, RSS_STEPS)) for name, step in steps.items()}
    ours = full_state_dict(run)
    theirs = {name: p.full_tensor() for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        diff = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
        print(f"bench zero: model={cfg.model} world={cfg.world_size} global_batch={cfg.global_batch} "
              f"microbatches={cfg.microbatches} units={len(default_units(model))} device={mesh.device.type}")
        _print_memory(cfg, rows)
        print("  trainmesh --zero 3 vs torch FSDP2 fully_shard, alternating timed rounds:")
        for name, rate in rates.items():
            print(f"    {name:<10} {rate:12,.0f} tokens/s  model_state_bytes {_mb(held[name])}  "
                  f"peak RSS {_mb(rss[name])}")
        print(f"    ratio trainmesh/fsdp2 = {rates['trainmesh'] / rates['fsdp2']:.3f} tokens/s, "
              f"{max(held['trainmesh']) / max(held['fsdp2']):.3f} model state, "
              f"{max(rss['trainmesh']) / max(rss['fsdp2']):.3f} peak RSS")
        print(f"    max |param diff| after the same steps: {diff:.2e}")
    return rates
