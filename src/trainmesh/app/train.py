"""The training loop: composes the mesh, the model, a parallel form and the data into optimizer steps.

The logged loss is the mean over the global batch, the quantity a single process computes, which is
what makes layouts comparable."""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainmesh.distributed.agreement import check_agreement
from trainmesh.distributed.comm import Comm, log_all_reduce
from trainmesh.app.config import Config, vocabulary_note
from trainmesh.data import TokenData, documents_from_eos, get_batch, pin_tokenizer
from trainmesh.training.engine import MicroBatches
from trainmesh.app.run import Run
from trainmesh.checkpoint.store import all_gather_json
from trainmesh.replicas import ReplicaGroup
from trainmesh.distributed.heartbeat import PROGRESS, start_heartbeat, stepping
from trainmesh.distributed.elastic import die_with_agent
from trainmesh.distributed.mesh import Mesh, world_from_env
from trainmesh.tracking import metrics
from trainmesh.tracking.metrics import STRAGGLER_FACTOR, SavedActivations, mfu, peak_tflops, stragglers
from trainmesh.tracking.records import LossWindows, MetricsError
from trainmesh.tracking.runlog import RunLog
from trainmesh.models import moe, spec_of
from trainmesh.models.documents import packed
from trainmesh.training.optim import LRSchedule
from trainmesh.pipeline.draw import draw_timeline
from trainmesh.plan.timing import model_flops_per_token
from trainmesh.pipeline.simulate import Costs, measured_costs, replayed_bubble, simulate
from trainmesh.training.loss import micro_loss
from trainmesh.training.precision import dtype_of
from trainmesh.tracking.profiling import StepProfiler
from trainmesh import api, checkpoint
from trainmesh.app import checkpoints

FAULT_ENV = "TRAINMESH_FAULT"
SLOW_FAULT_S = 0.5  # what ``slow@RANK:STEP`` adds to the rank's compute of each step it names
EVAL_STEP_BASE = 1_000_000_000  # eval batches are drawn as steps the training run never reaches

@dataclass
class TrainResult:
    losses: list[float]
    val_loss: float
    summary: dict[str, Any]
    run: Run = field(repr=False)


def setup_process(cfg: Config) -> Mesh:
    """Join the process group and build the mesh as :func:`trainmesh.api.init_mesh` does, plus what the launcher
    needs: SIGUSR1 prints every thread's stack (for hang reports), a rank of an elastic agent ends with it, and a
    heartbeat with a watchdog names a dead, stopped or stuck peer within ``--peer-timeout``."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    die_with_agent()
    if cfg.launch.debug_collectives:
        torch.distributed.set_debug_level(torch.distributed.DebugLevel.DETAIL)
    mesh = api.init_mesh(cfg.layout.dp, cfg.layout.tp, cfg.layout.pp, cfg.layout.cp, cfg.launch.device, cfg.launch.backend, cfg.launch.collective_timeout, cfg.layout.ep,
                         cfg.layout.dp_replicate, cfg.layout.sequence_parallel, cfg.layout.etp)
    start_heartbeat(cfg.launch.peer_timeout)
    return mesh


def build(cfg: Config, mesh: Mesh) -> Run:
    """Build the model of ``cfg.model.model``'s family from the seed and apply the configured parallel forms to it
    through the public API (:func:`trainmesh.api.parallelize`, :func:`trainmesh.api.optimizer`)."""
    comm = Comm(mesh)
    spec = spec_of(cfg.model.model)
    model = spec.builder(cfg.model_config, cfg.model.seed).to(mesh.device, dtype_of(cfg.layout.precision))
    check_agreement(cfg.shared_settings(), model, mesh.device)
    parallel = api.parallelize(model, mesh, tp_plan=dict(spec.tp_plan), comm=comm, **cfg.layout.forms())
    opt = api.optimizer(parallel, cfg.optim.lr, (cfg.optim.beta1, cfg.optim.beta2), cfg.optim.weight_decay)
    parallel.description = (parallel.description[0], {**parallel.description[1],
                                                      "source": checkpoints.model_source(cfg)})
    tokenizer = pin_tokenizer(cfg.data.data, cfg.data.tokenizer)
    data = TokenData.load(cfg.data.data, cfg.model_config.seq_len, cfg.data.tokenizer)
    return Run(cfg, parallel, opt, data, tokenizer)


def rank_share(run: Run, tokens: torch.Tensor, step: int, global_batch: int,
               group: int = 0) -> tuple[torch.Tensor, ...]:
    """This data-parallel rank's share of the global batch of ``step`` (only its sequences are read): inputs and
    targets, and under ``--document-mask`` each input token's document (for chat data, its conversation). Replica
    group ``group`` (``--replica-group``) draws batches of its own."""
    cfg, mesh = run.cfg, run.mesh
    x, y, *documents = get_batch(tokens, cfg.model_config.seq_len, global_batch, cfg.model.seed + group, step,
                                 mesh.rank("dp"), mesh.size("dp"))
    if not cfg.data.document_mask:
        return x, y
    return x, y, documents[0] if documents else documents_from_eos(x, run.data.eos_id)


def rank_batch(run: Run, tokens: torch.Tensor, step: int, global_batch: int) -> MicroBatches:
    """This rank's micro-batches of the global batch of ``step``, on the rank's device."""
    return api.rank_slice(run.mesh, rank_share(run, tokens, step, global_batch), run.cfg.layout.microbatches, dp_sliced=True)


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss over ``eval_batches`` global batches, each the mean over its trained tokens as in
    training."""
    run.model.eval()
    losses = []
    for k in range(run.cfg.optim.eval_batches):
        micro = rank_batch(run, run.data.val, EVAL_STEP_BASE + k, run.cfg.optim.global_batch)
        shares, _ = api.token_divisors(run.mesh, micro)
        if run.pipeline is not None:
            loss = run.pipeline.evaluate(micro, run.criterion, shares)
        else:
            loss = sum(_eval_loss(run, mb, d) for mb, d in zip(micro, shares))
        losses.append(api.global_mean(run.mesh, loss))
    run.model.train()
    return sum(losses) / len(losses)


def _eval_loss(run: Run, micro_batch: tuple, divisor: float) -> torch.Tensor:
    x, y, *packing = micro_batch
    with packed(*packing):
        return micro_loss(run.criterion, run.model(x), y, divisor)


def perplexity(loss: float) -> float:
    """exp of a mean cross-entropy in nats: the effective number of equally likely next tokens."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def draw_pipeline_timeline(run: Run, path: str) -> str:
    """Draw the recorded step's measured pipeline timeline (rank 0 of the world draws its pipeline's), and
    write its measured costs beside it, so ``trainmesh schedule --costs`` simulates the same step."""
    timeline = run.pipeline.gather_timeline()
    *_, transfer = run.pipeline.transfer_seconds(run.cfg.micro_batch, run.cfg.model_config.seq_len)
    if run.mesh.global_rank() != 0:
        return ""
    cfg = run.cfg
    costs = measured_costs([timeline], run.pipeline.n_stages, transfer, run.pipeline.lone).save(Path(path).with_suffix(".costs.json"))
    saved = Costs.load(costs)  # the figure trainmesh schedule --costs will print, rounding included
    simulated = simulate(run.pipeline.schedule, saved).bubble_fraction
    replayed = replayed_bubble(run.pipeline.schedule, saved, [timeline], link=transfer)
    title = f"measured {cfg.layout.schedule} pp={cfg.layout.pp} m={cfg.layout.microbatches} v={cfg.layout.virtual_stages}"
    return (f"pipeline timeline of the last step drawn to {draw_timeline(timeline, path, title=title)}: measured "
            f"bubble {timeline.bubble_fraction:.4f}, simulated from its measured costs {simulated:.4f} "
            f"({replayed:.4f} with each action's and message's own measured time; "
            f"trainmesh schedule --pp {cfg.layout.pp} --microbatches {cfg.layout.microbatches} --schedule {cfg.layout.schedule} "
            f"--virtual-stages {cfg.layout.virtual_stages} --costs {costs})")


def inject_fault(run: Run, step: int, rank: int) -> Callable[[], None]:
    """Apply ``TRAINMESH_FAULT=KIND@RANK:STEP`` (``*``: every step) if it names this rank and step; returns an
    undo function. Kinds ``raise``, ``kill`` (SIGKILL, as the OOM killer), ``hang`` (a loop that calls no
    collective; its heartbeat goes on), ``stop`` (SIGSTOP: frozen, heartbeat too), ``slow`` (sleeps SLOW_FAULT_S:
    a straggler) and ``nan`` (NaN gradients, every rank must skip the step) test the launcher and the recovery
    paths (docs/reliability.md)."""
    spec = os.environ.get(FAULT_ENV, "")
    kind, _, where = spec.partition("@")
    fault_rank, _, fault_step = where.partition(":")
    if not spec or int(fault_rank) != rank or fault_step not in (str(step), "*"):
        return lambda: None
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({FAULT_ENV}={spec})")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return lambda: None
    if kind == "slow":
        time.sleep(SLOW_FAULT_S)
        return lambda: None
    if kind == "nan":
        first = next(p for p in run.model.parameters() if p.requires_grad)
        return first.register_hook(lambda g: torch.full_like(g, float("nan"))).remove
    raise ValueError(f"{FAULT_ENV}={spec}: unknown fault kind {kind!r}; use raise, kill, hang, stop, slow or nan")


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class NonFiniteGuard:
    """Counts skipped (non-finite) steps; every rank sees the same global norm, so all stop together."""

    limit: int
    consecutive: int = 0
    total: int = 0

    def observe(self, grad_norm: float, step: int) -> None:
        if math.isfinite(grad_norm):
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.limit:
            raise TrainingDiverged(
                f"{self.consecutive} consecutive steps up to step {step} had a non-finite loss or gradient and "
                f"were skipped; stopping. Lower --lr, try --precision bf16, or check the data "
                f"(--max-bad-steps sets the limit)")


def moe_metrics(run: Run) -> dict[str, dict[str, Any]]:
    """Per MoE layer, over the step's global batch: token copies per expert, the fraction dropped by capacity,
    the mean balance and z losses (unweighted) and max/mean expert load. One uncounted all-reduce over dp
    (and a gather over pipeline stages, for rank 0's record); empty for a dense model."""
    layers = list(moe.moe_layers(run.model))
    out = {}
    if layers:
        rows = [torch.cat([layer.stats.counts.double().cpu(),
                           torch.tensor([layer.stats.dropped, layer.stats.routed, layer.stats.aux_loss,
                                         layer.stats.z_loss, layer.stats.forwards], dtype=torch.float64)])
                for _, layer in layers]
        sizes = [len(row) for row in rows]
        summed = api.sum_over_data(run.mesh, torch.cat(rows), "moe_metrics").cpu().split(sizes)
        for (name, _), row in zip(layers, summed):
            counts, (dropped, routed, aux, z, forwards) = row[:-5], row[-5:].tolist()
            out[name] = {"expert_tokens": [int(c) for c in counts.tolist()],
                         "dropped_fraction": dropped / max(routed, 1), "aux_loss": aux / max(forwards, 1),
                         "z_loss": z / max(forwards, 1),
                         "balance": (counts.max() / counts.mean()).item() if routed else 1.0}
    if run.mesh.size("pp") == 1:
        return out
    stages = all_gather_json(out, run.mesh.device, run.mesh.group("pp"))
    return {name: layer for stage in stages for name, layer in stage.items()}


def per_rank_stats(run: Run, activation_bytes: int, split: tuple[float, float] | None = None) -> dict[str, list]:
    """Each rank's memory and, given this rank's ``split``, each rank's step split into computing and waiting
    (:func:`trainmesh.tracking.metrics.per_rank_stats`), gathered to all."""
    return metrics.per_rank_stats(run.engine.state_tensors(), run.mesh.device, activation_bytes, split)


def straggler_line(record: dict[str, Any], hosts: list[str]) -> str:
    """The line naming the stragglers of ``record``'s step, each with its host and compute against the median;
    or saying that the ranks it named before keep pace again."""
    compute, waits = record["compute_s"], record["wait_s"]
    median = statistics.median_low(compute)
    if "stragglers" not in record:
        return f"trainmesh: no straggler at step {record['step']}: every rank computes within {STRAGGLER_FACTOR:g}x the median"
    named = "; ".join(f"rank {r} on {hosts[r]} computed {compute[r]:.2f} s ({compute[r] / max(median, 1e-9):.1f}x the "
                      f"median rank's {median:.2f} s, waiting {waits[r]:.2f} s)" for r in record["stragglers"])
    return (f"trainmesh: straggler at step {record['step']}: {named}; the others waited for it "
            f"(named above {STRAGGLER_FACTOR:g}x the median; compute_s and wait_s in metrics.jsonl)")


def _delta(now: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: round(v - before.get(k, 0.0)) for k, v in now.items() if v - before.get(k, 0.0)}


def write_metrics(log: RunLog, record: dict[str, Any]) -> str:
    """Write and show ``record``; the error if that failed ("" if not), for :func:`stop_if_metrics_failed`."""
    try:
        log.log(**record)
    except MetricsError as e:
        return str(e)
    return ""


class RunStopped(RuntimeError):
    """This rank stopped because another one failed (it said why); the rank itself did nothing wrong."""


def stop_if_metrics_failed(run: Run, error: str, done: checkpoint.TrainingProgress) -> None:
    """Stop every rank together, after a final checkpoint attempt, if rank 0 could not write its metrics
    (``error``): a run must not go on unrecorded. One small all-reduce per step tells the others; rank 0
    raises :class:`MetricsError`, the others :class:`RunStopped`, so the error is reported once."""
    failed = log_all_reduce(torch.tensor([int(bool(error))], device=run.mesh.device),
                            reduce_op=torch.distributed.ReduceOp.MAX)
    if not failed.item():
        return
    note = "no --checkpoint-dir is set, so this run's weights are not saved"
    if run.cfg.checkpoint.checkpoint_dir:
        try:
            saved = (checkpoint.step_dir(Path(run.cfg.checkpoint.checkpoint_dir), done.step) if checkpoints.due(run.cfg, done.step)
                     else checkpoints.save(run, done))
            note = f"{saved} holds step {done.step}; free space and continue with --resume"
        except checkpoint.CheckpointError as e:
            note = f"the final checkpoint failed too: {e}"
    if run.mesh.global_rank() != 0:
        raise RunStopped(f"rank 0 could not write its metrics; stopped after step {done.step}; {note}")
    raise MetricsError(f"{error}; stopped after step {done.step}; {note}")


def save_checkpoint(run: Run, done: checkpoint.TrainingProgress, saves: list[Callable[[], dict]]) -> None:
    """Save after ``done.step`` steps, in the background under ``--checkpoint-async`` (after the save still in
    flight); appends to ``saves`` what the summary reports of it: the training stall (the whole save, or a
    background save's copy to host memory, with ``waited_s`` spent first waiting for the save in flight) and a
    background save's write time (read at the end, once written)."""
    start = time.perf_counter()
    if not run.cfg.checkpoint.checkpoint_async:
        checkpoints.save(run, done)
        stall = time.perf_counter() - start
        saves.append(lambda: {"step": done.step, "stall_s": stall, "write_s": None})
        return
    handle = checkpoints.save(run, done, async_=True)
    waited = time.perf_counter() - start - handle.stall_s  # for the previous save's write, before this copy
    saves.append(lambda: {"step": done.step, "stall_s": handle.stall_s, "waited_s": waited, "write_s": handle.write_s})


def replica_group(run: Run, step: int) -> ReplicaGroup | None:
    """``--lighthouse``: this run as one torchft replica group (:class:`trainmesh.replicas.ReplicaGroup`) that
    resumes at ``step``; None without it."""
    launch = run.cfg.launch
    if not launch.lighthouse:
        return None
    return ReplicaGroup(run.parallel, run.opt, launch.lighthouse, launch.replica_group, step=step,
                        timeout_s=launch.replica_timeout)


def train(cfg: Config, mesh: Mesh | None = None) -> TrainResult:
    """Train up to step ``cfg.optim.steps`` (from the checkpoint ``--resume`` finds, if any; ``losses`` holds the
    steps run here); rank 0 writes metrics under ``cfg.logging.out`` and prints progress."""
    mesh = mesh or setup_process(cfg)
    run = build(cfg, mesh)
    keeper = checkpoints.snapshots(run)
    start = checkpoints.restore(run, keeper)
    rank, _ = world_from_env()
    resume_from = start.step if cfg.checkpoint.resume else None
    log = RunLog(cfg.logging.out, cfg.optim.steps, first_step=start.step + 1, resume_from=resume_from, config=cfg.settings(),
                 name=checkpoints.model_source(cfg), tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                 progress=cfg.logging.progress, progress_every=cfg.logging.progress_every, lock=False)
    progress = log.progress
    progress.message(f"trainmesh: {log.name} ({cfg.model_config.n_params():,} params) on {run.data.source}, "
                     f"dp={cfg.layout.dp} cp={cfg.layout.cp} tp={cfg.layout.tp} pp={cfg.layout.pp}{f' ep={cfg.layout.ep}' if cfg.layout.ep > 1 else ''} zero={cfg.layout.zero}, {mesh.world_size} rank(s), "
                     f"{mesh.device.type}")
    if vocabulary_note(cfg):
        progress.message(f"trainmesh: {vocabulary_note(cfg)}")
    shape = spec_of(cfg.model.model).shape(cfg.model_config)
    tokens_per_step = cfg.optim.global_batch * shape.seq_len
    flops_per_token = model_flops_per_token(shape)
    peak = peak_tflops(mesh.device, cfg.layout.precision, cfg.logging.peak_tflops)
    saved = SavedActivations(run.model.parameters())
    schedule = LRSchedule(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.optim.steps)
    guard = NonFiniteGuard(cfg.optim.max_bad_steps, start.bad_steps_in_a_row, start.skipped_steps)
    profiler = StepProfiler(cfg.optim.steps - cfg.logging.profile_steps, cfg.optim.steps - 1, mesh.device) if cfg.logging.profile_steps \
        else None
    saves, named = [], []
    armed = not (cfg.launch.elastic and start.step)  # an injected fault is one-off: an elastic restart resumes without it
    hosts = all_gather_json(socket.gethostname(), mesh.device)
    group = replica_group(run, start.step)
    for step in group.steps(cfg.optim.steps) if group else range(start.step, cfg.optim.steps):
        if profiler is not None:
            profiler.before(step)
        t0, waited_before = time.perf_counter(), PROGRESS.waited_s
        if run.pipeline is not None:
            run.pipeline.recording = bool(cfg.layout.timeline) and step == cfg.optim.steps - 1
        comm_before, by_op_before = run.comm.totals(), run.comm.snapshot()
        run.opt.lr = lr = schedule.at(step)
        with stepping():
            undo_fault = inject_fault(run, step, rank) if armed else lambda: None
            batch = rank_share(run, run.data.train, step, cfg.optim.global_batch, cfg.launch.replica_group)
            loss = api.train_step(run.parallel, run.opt, batch, max_norm=cfg.optim.grad_clip, dp_sliced=True,
                                  saved=saved if step == start.step else None)
        grad_norm = run.opt.grad_norm
        undo_fault()
        if group and not group.committed(step):  # a replica group was lost during it: the next quorum trains it again
            continue
        guard.observe(grad_norm, step + 1)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize(mesh.device)
        step_time, waited = time.perf_counter() - t0, PROGRESS.waited_s - waited_before
        if profiler is not None:
            profiler.after(step)
        record = {"step": step + 1, "loss": loss, "trained_tokens": run.opt.trained_tokens, "lr": lr, "grad_norm": grad_norm,
                  "skipped": not math.isfinite(grad_norm), "skipped_steps": guard.total,
                  "loss_scale": run.engine.loss_scale,
                  "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                  "mfu": mfu(tokens_per_step / step_time, flops_per_token, mesh.world_size, peak),
                  "comm_bytes": _delta(run.comm.totals(), comm_before),
                  "comm_bytes_by_op": _delta(run.comm.snapshot(), by_op_before),
                  **per_rank_stats(run, saved.bytes, (step_time - waited, waited))}
        slow = stragglers(record["compute_s"])
        if slow:
            record["stragglers"] = slow
        if slow != named:
            named = slow
            progress.message(straggler_line(record, hosts))
        if step == start.step:  # a run's (or a restart's) first record names the layout it runs
            record["layout"] = run.parallel.layout.record()
        if group:
            record["replica_groups"] = group.participants
        experts = moe_metrics(run)
        if experts:
            record["moe"] = experts
        if (cfg.optim.eval_every and (step + 1) % cfg.optim.eval_every == 0) or step + 1 == cfg.optim.steps:
            record["val_loss"] = evaluate(run)
            record["val_perplexity"] = perplexity(record["val_loss"])
        metrics_error = write_metrics(log, record)
        done = checkpoint.TrainingProgress(step + 1, guard.total, guard.consecutive, start.run_id)
        if checkpoints.due(cfg, step + 1):
            with progress.paused():
                save_checkpoint(run, done, saves)
        if keeper is not None:
            keeper.after_step(run.model, run.engine, done, step_time)
        with progress.paused() if metrics_error else contextlib.nullcontext():
            stop_if_metrics_failed(run, metrics_error, done)
    if run.parallel.pending_save is not None:
        run.parallel.pending_save.wait()
    if group:
        group.close()
    if keeper is not None:
        keeper.remove()
    progress.close()
    if profiler is not None:
        progress.message(profiler.finish(Path(cfg.logging.out) / "profile" / f"rank{rank}.json" if cfg.logging.out else None))
    if cfg.layout.timeline:
        progress.message(draw_pipeline_timeline(run, cfg.layout.timeline))
    val_loss = record["val_loss"]  # the last step always evaluates
    tokens_per_s = tokens_per_step / log.steady_step_time
    summary = log.summary(val_loss=val_loss, val_perplexity=perplexity(val_loss), tokens_per_s=tokens_per_s,
                          mfu=mfu(tokens_per_s, flops_per_token, mesh.world_size, peak),
                          world_size=mesh.world_size, transport=run.comm.transport,
                          checkpoint_saves=[save() for save in saves],
                          **per_rank_stats(run, saved.bytes), config=cfg.settings())
    mfu_text = f", MFU {summary['mfu']:.1%}" if summary["mfu"] is not None else ""
    progress.message(f"done: {LossWindows.of(log.losses).text()}, val {val_loss:.4f} "
                     f"(perplexity {perplexity(val_loss):,.2f}), "
                     f"{tokens_per_s:,.0f} tok/s{mfu_text}" + (f"; metrics in {cfg.logging.out}" if cfg.logging.out else ""))
    log.close()
    return TrainResult(log.losses, val_loss, summary, run)
