"""Benchmarks that run a trainmesh parallel form and its PyTorch counterpart in one run and print figures.

Both implementations train the same model on the same batches on the same ranks. Timed rounds alternate
between them, so slow drift of the machine (other load, thermal state) hits both alike; the figure is
tokens per second over all timed steps. Nothing here asserts a speed: benchmarks print, tests check.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainmesh.config import Config
from trainmesh.models.gpt import GPT, cross_entropy
from trainmesh.optim import build_adamw
from trainmesh.precision import dtype_of
from trainmesh.train import Run, build, forward_backward, rank_batch, setup_process

StepFn = Callable[[int], None]


def _trainmesh_step(run: Run) -> StepFn:
    def step(i: int) -> None:
        forward_backward(run, rank_batch(run, run.data.train, i, run.cfg.global_batch))
        run.engine.step(run.cfg.lr, run.cfg.grad_clip)

    return step


def _ddp_step(run: Run) -> StepFn:
    """The same training step with torch DDP (same bucket size) and torch's own gradient clipping."""
    cfg, device = run.cfg, run.mesh.device
    model = GPT(cfg.model_config, seed=cfg.seed).to(device, dtype_of(cfg.precision))
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True,
                                  device_ids=[device] if device.type == "cuda" else None)
    optimizer = build_adamw(model.named_parameters(), cfg, device)

    def step(i: int) -> None:
        micro = rank_batch(run, run.data.train, i, cfg.global_batch)
        for k, (x, y) in enumerate(micro):
            ctx = ddp.no_sync() if k < len(micro) - 1 else torch.enable_grad()
            with ctx:
                (cross_entropy(ddp(x), y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def _timed(step: StepFn, first: int, count: int, device: torch.device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(first, first + count):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter() - t0


def compare(steps: dict[str, StepFn], tokens_per_step: int, rounds: int, steps_per_round: int,
            device: torch.device) -> dict[str, float]:
    """Tokens/s of each step function over alternating timed rounds, after one warm-up round each."""
    elapsed = dict.fromkeys(steps, 0.0)
    for step in steps.values():
        _timed(step, 0, 2, device)
    for r in range(rounds):
        for name, step in steps.items():
            elapsed[name] += _timed(step, 2 + r * steps_per_round, steps_per_round, device)
    return {name: tokens_per_step * rounds * steps_per_round / t for name, t in elapsed.items()}


def bench_dp(cfg: Config, rounds: int, steps_per_round: int) -> dict[str, float]:
    """trainmesh :class:`~trainmesh.data_parallel.DataParallel` vs ``DistributedDataParallel``."""
    if cfg.world_size < 2:
        raise SystemExit("trainmesh bench dp needs at least 2 ranks: pass --nproc N --dp N")
    mesh = setup_process(cfg)
    run = build(cfg, mesh)
    tokens_per_step = cfg.global_batch * cfg.model_config.seq_len
    rates = compare({"trainmesh": _trainmesh_step(run), "torch_ddp": _ddp_step(run)}, tokens_per_step,
                    rounds, steps_per_round, mesh.device)
    if dist.get_rank() == 0:
        print(f"bench dp: model={cfg.model} world={cfg.world_size} global_batch={cfg.global_batch} "
              f"microbatches={cfg.microbatches} bucket_mb={cfg.bucket_mb} device={mesh.device.type}")
        for name, rate in rates.items():
            print(f"  {name:<10} {rate:12,.0f} tokens/s")
        print(f"  ratio trainmesh/torch_ddp = {rates['trainmesh'] / rates['torch_ddp']:.3f}")
    return rates
