"""``trainmesh bench pp``: each pipeline schedule's measured bubble against the simulator's prediction,
and each schedule against ``torch.distributed.pipelining``'s class of the same name in tokens/s.

Bubble: measured, ``simulated`` (mean costs), ``replayed`` (each step's own) and ``uniform`` (textbook);
throughput in timed pairs (:func:`trainmesh_bench.common.compare`). Method: docs/performance.md."""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from trainmesh.layout import LayoutError, flag, validate
from trainmesh.models import spec_of
from trainmesh.training.optim import build_adamw, global_norm, unscale_and_clip_
from trainmesh.pipeline.partition import partition_model, split_model
from trainmesh.pipeline.schedules import Schedule
from trainmesh.pipeline.simulate import measured_costs, predicted_bubble, replayed_bubble, simulate
from trainmesh_bench.common import (Bench, Result, Setup, StepFn, build, compare, fresh_model, init_mesh, rss_after,
                                    trainmesh_step)

def _bubbles(bench: Bench, steps: int, transfer: float) -> tuple[float, float, float, float, float]:
    """(measured, simulated with each step's mean costs, simulated with each recorded step's own durations,
    uniform textbook) bubble fraction of ``bench``'s schedule, and the mean time a message took in its steps."""
    pipeline, step = bench.model.pipeline, trainmesh_step(bench)
    step(0)
    timelines = []
    pipeline.recording = True
    for i in range(1, steps + 1):
        step(i)
        timelines.append(pipeline.gather_timeline())
    pipeline.recording = False
    schedule: Schedule = pipeline.schedule
    costs = measured_costs(timelines, pipeline.n_stages, transfer, pipeline.lone)
    measured = statistics.median(t.bubble_fraction for t in timelines)
    predicted = predicted_bubble(schedule, timelines, pipeline.n_stages, transfer, pipeline.lone)
    replayed = replayed_bubble(schedule, costs, timelines, link=transfer)
    return measured, predicted, replayed, simulate(schedule).bubble_fraction, costs.comm


def _variants(cfg: Setup) -> list[tuple[Setup | None, str]]:
    """One config per schedule (interleaved with 2 chunks unless --virtual-stages says more), or why not."""
    out = []
    for name in ("gpipe", "1f1b", "interleaved", "zb"):
        v = max(cfg.virtual_stages, 2) if name == "interleaved" else 1
        variant = cfg.with_layout(schedule=name, virtual_stages=v, stage_layers=(), timeline="")
        try:
            validate(variant.layout, spec_of(cfg.model).shape(cfg.model_config), cfg.world, spell=flag, name=cfg.model)
            out.append((variant, name))
        except LayoutError as e:
            out.append((None, f"{name}: skipped ({e})"))
    return out


TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
NO_TORCH_PEER = {
    "zb": "torch's zero-bubble classes (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) need 2+ stages "
          "per rank; trainmesh zb is ZB-H1 with one, so torch has no schedule of the same shape",
}
BUBBLE_STEPS = 10
"""Recorded steps per schedule for the bubble: its median settles well before the timed pairs' count."""


def _torch_step(bench: Bench) -> StepFn:
    """The same training step with torch's ``PipelineStage`` (one per model chunk) and its schedule class of
    the same name as ``bench``'s, on the same partition."""
    cfg, mesh = bench.cfg, bench.mesh
    p, rank, device, v = mesh.size("pp"), mesh.rank("pp"), mesh.device, cfg.virtual_stages
    model = fresh_model(bench)
    module, chunks = split_model(model, partition_model(model, p * v), rank, p, v)
    stages = [PipelineStage(chunk, s, p * v, device, group=mesh.group("pp")) for s, chunk in sorted(chunks.items())]
    schedule = TORCH_SCHEDULES[cfg.schedule](stages if v > 1 else stages[0], cfg.microbatches,
                                             loss_fn=bench.model.criterion)
    first, last = 0 in chunks, p * v - 1 in chunks
    optimizer = build_adamw(module.named_parameters(), device, cfg.lr, cfg.betas, cfg.weight_decay)
    params = [q for q in module.parameters() if q.requires_grad]

    def step(i: int) -> None:
        micro = bench.micro_batches(i)
        x, y = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        schedule.step(*((x,) if first else ()), target=y if last else None, return_outputs=False)
        grads = [q.grad for q in params]
        unscale_and_clip_(grads, global_norm(grads, bench.model.comm, ("pp",)).item(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def bench_pp(cfg: Setup, pairs: int) -> list[Result]:
    """Bubble per schedule (measured vs simulated) and each schedule vs torch's class of the same name in
    tokens/s; prints on rank 0."""
    if cfg.pp < 2 or cfg.dp * cfg.tp != 1:
        raise SystemExit("trainmesh bench pp compares pipelines alone: pass --nproc P --pp P with P >= 2")
    if cfg.microbatches < cfg.pp:
        raise SystemExit(f"torch's pipeline schedules need --microbatches >= --pp; got {cfg.microbatches} < {cfg.pp}")
    mesh = init_mesh(cfg)
    lines = [f"bench pp: model={cfg.model} pp={cfg.pp} microbatches={cfg.microbatches} "
             f"micro_batch={cfg.micro_batch} device={mesh.device.type} threads/rank={torch.get_num_threads()}",
             f"  {'schedule':<12} {'v':>2} {'measured':>9} {'simulated':>10} {'replayed':>9} {'uniform':>8} {'message':>8}"
             f"   (bubble fractions; message: mean ms a message took in the steps)"]
    results, transfer = [], None
    for variant, label in _variants(cfg):
        if variant is None:
            lines.append(f"  {label}")
            continue
        bench = build(variant, mesh)
        if transfer is None:  # the link is measured once per run, with the first pipeline's activations
            latency, bandwidth, transfer = bench.model.pipeline.transfer_seconds(cfg.micro_batch, cfg.model_config.seq_len)
            rate = f"{bandwidth / 1e9:.2f} GB/s" if math.isfinite(bandwidth) else "no size effect above the noise"
            lines.insert(1, f"  p2p latency {latency * 1e3:.3f} ms + {rate}: {transfer * 1e3:.3f} ms per activation")
        measured, simulated, replayed, uniform, message = _bubbles(bench, BUBBLE_STEPS, transfer)
        lines.append(f"  {label:<12} {variant.virtual_stages:>2} {measured:>9.3f} {simulated:>10.3f} {replayed:>9.3f} "
                     f"{uniform:>8.3f} {message * 1e3:>8.3f}")
        results.append(_versus_torch(bench, label, pairs))
    lines += [r.line() for r in results]
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    return results


def _versus_torch(bench: Bench, schedule: str, pairs: int) -> Result:
    """trainmesh's ``schedule`` against torch's class of the same name (or why there is none)."""
    cfg = bench.cfg
    ours = f"trainmesh {schedule} pp{cfg.pp}"
    peer = f"torch {TORCH_SCHEDULES[schedule].__name__}" if schedule in TORCH_SCHEDULES else "none"
    steps = {"trainmesh": trainmesh_step(bench)}
    if schedule in TORCH_SCHEDULES:
        steps["torch"] = _torch_step(bench)
    rates = compare(steps, cfg.global_batch * cfg.model_config.seq_len, pairs, bench.mesh.device)
    rss = rss_after(steps, pairs)
    return Result(f"pp {schedule}", ours, peer, rates["trainmesh"], rates.get("torch", []), rss["trainmesh"],
                  rss.get("torch", []), NO_TORCH_PEER.get(schedule, ""))
