"""``trainmesh bench pp``: each pipeline schedule's measured bubble against the simulator's prediction,
and each schedule against ``torch.distributed.pipelining``'s class of the same name in tokens/s
(``ScheduleGPipe``, ``Schedule1F1B``; the rows of the others say why they have no peer here).

Bubble: every schedule trains a few recorded steps; the runtime times each action on a clock aligned
across the pipeline at a barrier, and the measured bubble is the median over steps of the idle share
of ``ranks x makespan`` (:attr:`~trainmesh.pipeline.simulate.Timeline.bubble_fraction`). The prediction
simulates the same action lists with the measured duration of each (action kind, stage) and the measured
point-to-point latency, so the difference between the two is what the simulator does not model: Gloo
moves a message only once its receive is posted (the simulator lets it fly from the send), host dispatch,
other load on the machine. ``uniform`` is the textbook figure (F=1, B=2 per stage, free communication).

Throughput: both train the same model with the same stage partition, micro-batches, AdamW and global-norm
clipping, in alternating timed rounds (:func:`trainmesh.bench.common.compare`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from trainmesh.bench.common import Result, StepFn, compare, rss_after, trainmesh_step
from trainmesh.comm import Comm, log_all_reduce
from trainmesh.config import Config, ConfigError, validate
from trainmesh.mesh import Mesh
from trainmesh.models import spec_of
from trainmesh.optim import build_adamw, global_norm, unscale_and_clip_
from trainmesh.pipeline.partition import partition_model, split_model
from trainmesh.pipeline.schedules import COMPUTE_KINDS, ActionKind, Schedule
from trainmesh.pipeline.simulate import Costs, Timeline, simulate
from trainmesh.precision import dtype_of
from trainmesh.run import Run
from trainmesh.train import build, rank_batch, setup_process

LATENCY_ROUNDS = 20
FIT_FRACTIONS = (0.25, 0.5, 1.0)


def p2p_seconds(mesh: Mesh, numel: int, dtype: torch.dtype) -> float:
    """Seconds for one ``numel`` message to reach the next pipeline rank while every rank sends one (the
    slowest rank's mean over a ring exchange)."""
    comm, p, r = Comm(mesh), mesh.size("pp"), mesh.rank("pp")
    send = torch.zeros(numel, dtype=dtype, device=mesh.device)
    recv = torch.empty_like(send)
    peers = [(send, mesh.global_rank(pp=(r + 1) % p))], [(recv, mesh.global_rank(pp=(r - 1) % p))]
    for _ in range(2):
        for work in comm.send_recv(*peers):
            work.wait()
    dist.barrier(group=mesh.group("pp"))
    start = time.perf_counter()
    for _ in range(LATENCY_ROUNDS):
        for work in comm.send_recv(*peers):
            work.wait()
    mean = torch.tensor([(time.perf_counter() - start) / LATENCY_ROUNDS])
    return log_all_reduce(mean, mesh.group("pp"), dist.ReduceOp.MAX).item()


def p2p_fit(mesh: Mesh, numel: int, dtype: torch.dtype) -> tuple[float, float]:
    """(latency s, bandwidth B/s): a least-squares line through the time of messages of a quarter, half and
    all of ``numel`` elements, measured once per run for the simulator's transfer term
    (:meth:`~trainmesh.pipeline.simulate.Costs.transfer`). A non-positive slope (noise swamping the size
    effect) leaves all of the time to the latency."""
    numels = [max(1, int(numel * f)) for f in FIT_FRACTIONS]
    times = [p2p_seconds(mesh, n, dtype) for n in numels]
    sizes = [n * dtype.itemsize for n in numels]
    mean_size, mean_time = statistics.fmean(sizes), statistics.fmean(times)
    slope = (sum((b - mean_size) * (t - mean_time) for b, t in zip(sizes, times))
             / sum((b - mean_size) ** 2 for b in sizes))
    if slope <= 0:
        return mean_time, float("inf")
    return max(mean_time - slope * mean_size, 0.0), 1.0 / slope


def measured_costs(timelines: list[Timeline], n_stages: int, comm: float) -> Costs:
    """Mean measured duration of each compute kind per global stage, and of posting one message; B stands
    for BI + BW where absent. A mean, not a median: a preempted action lengthens the measured step, and
    the simulated one must carry the same total work to be comparable."""
    durations: dict[tuple[ActionKind, int], list[float]] = defaultdict(list)
    posts = []
    for timeline in timelines:
        for record in timeline.records:
            if record.action.kind in COMPUTE_KINDS:
                durations[(record.action.kind, record.action.stage)].append(record.duration)
            else:
                posts.append(record.duration)

    def per_stage(kind: ActionKind) -> tuple[float, ...] | None:
        if (kind, 0) not in durations:
            return None
        return tuple(max(statistics.fmean(durations[(kind, s)]), 1e-9) for s in range(n_stages))

    bi, bw = per_stage(ActionKind.BI), per_stage(ActionKind.BW)
    backward = per_stage(ActionKind.B) or tuple(i + w for i, w in zip(bi, bw))
    return Costs(forward=per_stage(ActionKind.F), backward=backward, backward_input=bi, backward_weight=bw,
                 comm=comm, post=statistics.fmean(posts) if posts else 0.0)


def _bubbles(run: Run, steps: int, transfer: float) -> tuple[float, float, float]:
    """(measured, simulated with measured costs, uniform textbook) bubble fraction of ``run``'s schedule."""
    pipeline, step = run.pipeline, trainmesh_step(run)
    step(0)
    timelines = []
    pipeline.recording = True
    for i in range(1, steps + 1):
        step(i)
        timelines.append(pipeline.gather_timeline())
    pipeline.recording = False
    schedule: Schedule = pipeline.schedule
    costs = measured_costs(timelines, pipeline.n_stages, transfer)
    measured = statistics.median(t.bubble_fraction for t in timelines)
    return measured, simulate(schedule, costs).bubble_fraction, simulate(schedule).bubble_fraction


def _variants(cfg: Config) -> list[tuple[Config | None, str]]:
    """One config per schedule (interleaved with 2 chunks unless --virtual-stages says more), or why not."""
    out = []
    for name in ("gpipe", "1f1b", "interleaved", "zb"):
        v = max(cfg.virtual_stages, 2) if name == "interleaved" else 1
        variant = dataclasses.replace(cfg, schedule=name, virtual_stages=v, stage_layers="", timeline="")
        try:
            validate(variant, world_size=cfg.world_size)
            out.append((variant, name))
        except ConfigError as e:
            out.append((None, f"{name}: skipped ({e})"))
    return out


TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
NO_TORCH_PEER = {
    "interleaved": "torch's ScheduleInterleaved1F1B needs several PipelineStages per rank; not wired here",
    "zb": "torch's zero-bubble schedules need a split weight-gradient stage API; not wired here",
}


def _torch_step(run: Run) -> StepFn:
    """The same training step with torch's ``PipelineStage`` and its schedule class of the same name as
    ``run``'s, on the same partition."""
    cfg, mesh = run.cfg, run.mesh
    p, rank, device = mesh.size("pp"), mesh.rank("pp"), mesh.device
    model = spec_of(cfg.model).builder(cfg.model_config, cfg.seed).to(device, dtype_of(cfg.precision))
    module, _ = split_model(model, partition_model(model, p), rank, p)
    stage = PipelineStage(module, rank, p, device, group=mesh.group("pp"))
    schedule = TORCH_SCHEDULES[cfg.schedule](stage, cfg.microbatches, loss_fn=run.criterion)
    optimizer = build_adamw(module.named_parameters(), device, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)
    params = [q for q in module.parameters() if q.requires_grad]

    def step(i: int) -> None:
        micro = rank_batch(run, run.data.train, i, cfg.global_batch)
        x, y = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == p - 1 else None, return_outputs=False)
        grads = [q.grad for q in params]
        unscale_and_clip_(grads, global_norm(grads, run.comm, ("pp",)), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step


def bench_pp(cfg: Config, rounds: int, steps_per_round: int) -> list[Result]:
    """Bubble per schedule (measured vs simulated) and each schedule vs torch's class of the same name in
    tokens/s; prints on rank 0."""
    if cfg.pp < 2 or cfg.dp * cfg.tp != 1:
        raise SystemExit("trainmesh bench pp compares pipelines alone: pass --nproc P --pp P with P >= 2")
    if cfg.microbatches < cfg.pp:
        raise SystemExit(f"torch's pipeline schedules need --microbatches >= --pp; got {cfg.microbatches} < {cfg.pp}")
    mesh = setup_process(cfg)
    m, dtype = cfg.model_config, dtype_of(cfg.precision)
    numel = cfg.micro_batch * m.seq_len * m.d_model
    latency, bandwidth = p2p_fit(mesh, numel, dtype)
    transfer = Costs.transfer(latency, bandwidth, numel * dtype.itemsize)
    lines = [f"bench pp: model={cfg.model} pp={cfg.pp} microbatches={cfg.microbatches} "
             f"micro_batch={cfg.micro_batch} device={mesh.device.type} threads/rank={torch.get_num_threads()}; "
             f"p2p latency {latency * 1e3:.3f} ms + {bandwidth / 1e9:.2f} GB/s = {transfer * 1e3:.3f} ms "
             f"per activation",
             f"  {'schedule':<12} {'v':>2} {'measured':>9} {'simulated':>10} {'uniform':>8}   (bubble fraction)"]
    results = []
    for variant, label in _variants(cfg):
        if variant is None:
            lines.append(f"  {label}")
            continue
        run = build(variant, mesh)
        measured, simulated, uniform = _bubbles(run, rounds * steps_per_round, transfer)
        lines.append(f"  {label:<12} {variant.virtual_stages:>2} {measured:>9.3f} {simulated:>10.3f} {uniform:>8.3f}")
        results.append(_versus_torch(run, label, rounds, steps_per_round))
    lines += [r.line() for r in results]
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    return results


def _versus_torch(run: Run, schedule: str, rounds: int, steps_per_round: int) -> Result:
    """trainmesh's ``schedule`` against torch's class of the same name (or why there is none)."""
    cfg = run.cfg
    ours = f"trainmesh {schedule} pp{cfg.pp}"
    peer = f"torch {TORCH_SCHEDULES[schedule].__name__}" if schedule in TORCH_SCHEDULES else "none"
    steps = {"trainmesh": trainmesh_step(run)}
    if schedule in TORCH_SCHEDULES:
        steps["torch"] = _torch_step(run)
    rates = compare(steps, cfg.global_batch * cfg.model_config.seq_len, rounds, steps_per_round, run.mesh.device)
    rss = rss_after(steps, rounds, steps_per_round)
    return Result(f"pp {schedule}", ours, peer, rates["trainmesh"], rates.get("torch", []), rss["trainmesh"],
                  rss.get("torch", []), NO_TORCH_PEER.get(schedule, ""))
