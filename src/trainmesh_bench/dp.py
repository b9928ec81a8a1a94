"""trainmesh's data parallelism beside torch's ``DistributedDataParallel`` (same model, batches, bucket size),
and the bound on that ratio: each rank's share of the step with no gradient synchronisation at all."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainmesh.models.gpt import cross_entropy
from trainmesh.training.optim import build_adamw
from trainmesh_bench.common import (Bench, Result, Setup, StepFn, build, compare, fresh_model, init_mesh, rss_after,
                                    trainmesh_step)


def _ddp_step(bench: Bench) -> StepFn:
    """The same training step with torch DDP (same bucket size) and torch's own gradient clipping."""
    cfg, device = bench.cfg, bench.mesh.device
    model = fresh_model(bench)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True,
                                  device_ids=[device] if device.type == "cuda" else None)
    optimizer = build_adamw(model.named_parameters(), device, cfg.lr, cfg.betas, cfg.weight_decay)

    def step(i: int) -> None:
        micro = bench.micro_batches(i)
        for k, (x, y) in enumerate(micro):
            ctx = ddp.no_sync() if k < len(micro) - 1 else torch.enable_grad()
            with ctx:
                (cross_entropy(ddp(x), y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def unsynchronised_step(bench: Bench, model: nn.Module) -> StepFn:
    """Each rank's share of ``bench``'s step on ``model`` (a copy of its own), the gradients never
    synchronised: the same micro-batches, clipping and AdamW. No data parallelism computes less, so its speed
    over DDP's bounds what any can reach on these kernels and this machine."""
    cfg, device = bench.cfg, bench.mesh.device
    optimizer = build_adamw(model.named_parameters(), device, cfg.lr, cfg.betas, cfg.weight_decay)

    def step(i: int) -> None:
        micro = bench.micro_batches(i)
        for x, y in micro:
            (cross_entropy(model(x), y) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def bench_dp(cfg: Setup, pairs: int) -> list[Result]:
    """trainmesh :class:`~trainmesh.parallel.data_parallel.DataParallel` vs ``DistributedDataParallel``."""
    if cfg.world < 2:
        raise SystemExit("trainmesh bench dp needs at least 2 ranks: pass --nproc N --dp N")
    mesh = init_mesh(cfg)
    bench = build(cfg, mesh)
    steps = {"trainmesh": trainmesh_step(bench), "torch_ddp": _ddp_step(bench),
             "unsynchronised": unsynchronised_step(bench, fresh_model(bench))}
    rates = compare(steps, cfg.global_batch * cfg.model_config.seq_len, pairs, mesh.device)
    rss = rss_after(steps, pairs)
    results = [Result("dp", "trainmesh DataParallel", "torch DDP", rates["trainmesh"], rates["torch_ddp"],
                      rss["trainmesh"], rss["torch_ddp"]),
               Result("dp bound", "no gradient sync (bound)", "torch DDP", rates["unsynchronised"], rates["torch_ddp"],
                      rss["unsynchronised"], rss["torch_ddp"],
                      "each rank's step with no synchronisation at all: the most any data parallelism gains here")]
    if dist.get_rank() == 0:
        print(f"bench dp: model={cfg.model} world={cfg.world} global_batch={cfg.global_batch} "
              f"microbatches={cfg.microbatches} bucket_mb={cfg.bucket_mb} device={mesh.device.type}")
        print("\n".join(r.line() for r in results))
    return results
