"""trainmesh's data parallelism beside torch's ``DistributedDataParallel`` (same model, batches, bucket size)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainmesh.bench.common import Result, StepFn, compare, rss_after, trainmesh_step
from trainmesh.config import Config
from trainmesh.run import Run
from trainmesh.models import spec_of
from trainmesh.models.gpt import cross_entropy
from trainmesh.optim import build_adamw
from trainmesh.precision import dtype_of
from trainmesh.train import build, rank_batch, setup_process


def _ddp_step(run: Run) -> StepFn:
    """The same training step with torch DDP (same bucket size) and torch's own gradient clipping."""
    cfg, device = run.cfg, run.mesh.device
    model = spec_of(cfg.model).builder(cfg.model_config, cfg.seed).to(device, dtype_of(cfg.precision))
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True,
                                  device_ids=[device] if device.type == "cuda" else None)
    optimizer = build_adamw(model.named_parameters(), device, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)

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


def bench_dp(cfg: Config, pairs: int) -> list[Result]:
    """trainmesh :class:`~trainmesh.data_parallel.DataParallel` vs ``DistributedDataParallel``."""
    if cfg.world_size < 2:
        raise SystemExit("trainmesh bench dp needs at least 2 ranks: pass --nproc N --dp N")
    mesh = setup_process(cfg)
    run = build(cfg, mesh)
    steps = {"trainmesh": trainmesh_step(run), "torch_ddp": _ddp_step(run)}
    rates = compare(steps, cfg.global_batch * cfg.model_config.seq_len, pairs, mesh.device)
    rss = rss_after(steps, pairs)
    result = Result("dp", "trainmesh DataParallel", "torch DDP", rates["trainmesh"], rates["torch_ddp"],
                    rss["trainmesh"], rss["torch_ddp"])
    if dist.get_rank() == 0:
        print(f"bench dp: model={cfg.model} world={cfg.world_size} global_batch={cfg.global_batch} "
              f"microbatches={cfg.microbatches} bucket_mb={cfg.bucket_mb} device={mesh.device.type}")
        print(result.line())
    return [result]
