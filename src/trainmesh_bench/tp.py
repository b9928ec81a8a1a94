"""``trainmesh bench tp``: trainmesh tensor parallelism against PyTorch's ``parallelize_module``.

Both train the same model and layout; torch's plan is translated from the family's (:func:`torch_tp_plan`),
fused projections' rows reordered so both shard the same function. Timed in pairs (docs/performance.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch import nn
from torch.nn.utils import get_total_norm

from trainmesh.models import spec_of
from trainmesh.models.gpt import cross_entropy
from trainmesh.training.optim import build_adamw
from trainmesh.parallel.tensor_parallel import ShardSpec, match_plan, shard_tensor
from trainmesh_bench.common import (Bench, Result, Setup, StepFn, build, compare, fresh_model, init_mesh, rss_after,
                                    trainmesh_step)


CHUNKS = {"colwise": 1, "colwise_qkv": 3, "colwise_pair": 2}  # trainmesh's column styles: chunks split apart


@torch.no_grad()
def _rows_by_rank(linear: nn.Linear, chunks: int, tp: int) -> None:
    """Reorder a fused linear's rows so that rank r's contiguous 1/tp is its part of every chunk."""
    spec = ShardSpec(0, chunks=chunks)
    for p in (linear.weight, linear.bias):
        if p is not None:
            p.copy_(torch.cat([shard_tensor(p, spec, r, tp) for r in range(tp)]))


def torch_tp_plan(model: nn.Module, plan: dict[str, str], tp: int) -> dict:
    """The family's trainmesh plan in ``torch.distributed.tensor.parallel`` styles (sequence-parallel
    regions left out: the bench compares plain TP), fused column-parallel rows reordered for torch."""
    styles = {}
    for name, style in match_plan(model, plan).items():
        module = model.get_submodule(name)
        if style in CHUNKS:
            if CHUNKS[style] > 1:
                _rows_by_rank(module, CHUNKS[style], tp)
            styles[name] = ColwiseParallel()
        elif style == "rowwise":
            styles[name] = RowwiseParallel()
        elif style == "vocab":
            styles[name] = (RowwiseParallel(input_layouts=Replicate()) if isinstance(module, nn.Embedding)
                            else ColwiseParallel(use_local_output=False))
    return styles


def _torch_model(bench: Bench) -> nn.Module:
    """``bench``'s model under ``parallelize_module`` with its family's plan in torch's styles."""
    model, mesh = fresh_model(bench), bench.mesh
    plan = dict(spec_of(bench.cfg.model).tp_plan)
    return parallelize_module(model, mesh.device_mesh["tp"], torch_tp_plan(model, plan, mesh.size("tp")))


def _clip_mixed_(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """torch's clipping for a model of DTensor (split) and plain (LayerNorm) parameters, which
    ``clip_grad_norm_`` refuses to mix: the norm of each kind (DTensor reduces its own over tp), combined."""
    grads = [p.grad for p in params if p.grad is not None]
    split = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.stack([get_total_norm(split).full_tensor(), get_total_norm(plain)]).norm()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)


def _torch_tp_step(bench: Bench, model: nn.Module) -> StepFn:
    """The same step on DTensors: loss over vocabulary shards, clipping by the global norm, AdamW."""
    cfg = bench.cfg
    params = list(model.parameters())
    # foreach AdamW, like clipping, cannot mix DTensors and plain tensors in one call: one optimizer each.
    optimizers = [build_adamw([(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor) == split],
                              bench.mesh.device, cfg.lr, cfg.betas, cfg.weight_decay)
                  for split in (True, False)]

    def step(i: int) -> None:
        micro = bench.micro_batches(i)
        with loss_parallel():
            for x, y in micro:
                (cross_entropy(model(x), y) / len(micro)).backward()
        _clip_mixed_(params, cfg.grad_clip)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    return step


@torch.no_grad()
def _first_losses(bench: Bench, model: nn.Module) -> tuple[float, float]:
    """Both implementations' loss on the first batch before training: the same model gives the same loss."""
    x, y = bench.micro_batches(0)[0]
    mine = bench.model.criterion(bench.model(x), y).item()
    with loss_parallel():
        theirs = cross_entropy(model(x), y).full_tensor().item()
    return mine, theirs


def bench_tp(cfg: Setup, pairs: int) -> list[Result]:
    """trainmesh :func:`~trainmesh.parallel.tensor_parallel.apply_tensor_parallel` vs ``parallelize_module``, tokens/s."""
    if cfg.tp < 2 or cfg.dp != 1 or cfg.pp != 1 or cfg.zero or cfg.sequence_parallel:
        raise SystemExit("trainmesh bench tp compares plain tensor parallelism: pass --nproc N --tp N "
                         "(N >= 2) without --dp, --pp, --zero or --sequence-parallel")
    mesh = init_mesh(cfg)
    bench = build(cfg, mesh)
    model = _torch_model(bench)
    losses = _first_losses(bench, model)
    steps = {"trainmesh": trainmesh_step(bench), "torch_tp": _torch_tp_step(bench, model)}
    rates = compare(steps, cfg.global_batch * cfg.model_config.seq_len, pairs, mesh.device)
    rss = rss_after(steps, pairs)
    result = Result("tp", f"trainmesh tp{cfg.tp}", "torch DTensor parallelize_module", rates["trainmesh"],
                    rates["torch_tp"], rss["trainmesh"], rss["torch_tp"])
    if dist.get_rank() == 0:
        print(f"bench tp: model={cfg.model} tp={cfg.tp} global_batch={cfg.global_batch} "
              f"microbatches={cfg.microbatches} device={mesh.device.type}")
        print(f"  first-batch loss: trainmesh {losses[0]:.6f}, torch_tp {losses[1]:.6f}")
        print(result.line())
    return [result]
