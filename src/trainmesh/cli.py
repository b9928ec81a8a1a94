"""``trainmesh``: the command line.

``trainmesh train --nproc N`` checks the whole configuration, then spawns N local ranks through
:mod:`trainmesh.launcher`; each rank re-enters this same entry point with ``RANK`` set and trains. Under
torchrun ``RANK`` is set from the start, and under srun (more than one task) ``SLURM_PROCID``, so the
command runs as a rank directly (:func:`trainmesh.mesh.world_env`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainmesh import hf, runlock
from trainmesh.checkpoint import CheckpointError, check_resumable, claim, export, export_hf
from trainmesh.config import (Config, ConfigError, add_config_flags, check_value, config_from_args, parse_flag,
                              validate)
from trainmesh.data import DataError, TokenData
from trainmesh.mesh import STORE_CLIENT_ENV, world_env, world_from_env
from trainmesh.metrics import MetricsError
from trainmesh.rundir import check_run_dirs, default_out_dir


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that point at ``--help``."""

    def error(self, message: str):
        self.exit(2, f"trainmesh: error: {message} (see '{self.prog} --help')\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model", description="Train a model on one or many ranks.")
    add_config_flags(train)
    bench = sub.add_parser("bench", help="benchmark a parallel form against its PyTorch counterpart")
    bench.add_argument("form", choices=("dp", "zero", "pp", "tp", "all"),
                       help="dp: trainmesh DataParallel vs DistributedDataParallel; zero: each ZeRO stage vs "
                       "ZeroRedundancyOptimizer / FSDP2, and each stage's memory vs formula; pp: each schedule's "
                       "measured vs simulated bubble, and vs torch's schedule of the same name; tp: trainmesh "
                       "tensor parallel vs torch parallelize_module; all: every one of them, one launch each, "
                       "into one table (results.json and results.md in --out)")
    bench.add_argument("--rounds", type=int, default=7, help="alternating timed rounds per implementation")
    bench.add_argument("--steps-per-round", type=int, default=5, help="timed steps in each round")
    bench.add_argument("--results", default="", help="write this bench's rows as JSON to this file")
    add_config_flags(bench)
    _add_launch_parser(sub)
    _add_schedule_parser(sub)
    _add_plan_parser(sub)
    export = sub.add_parser("export", help="write a checkpoint's weights as one plain .safetensors model file "
                                           "or a Hugging Face model directory",
                            description="Assemble the unsharded weights of a checkpoint written in any layout into "
                                        "one safetensors file (load it back with train --init-from), or into a "
                                        "Hugging Face model directory (train --init-hf, or transformers' "
                                        "AutoModelForCausalLM.from_pretrained).")
    export.add_argument("checkpoint", help="a step-N checkpoint directory, or a --checkpoint-dir (its latest)")
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", metavar="FILE", help="the .safetensors file to write")
    target.add_argument("--hf", metavar="DIR", help="the directory to write config.json and model.safetensors to "
                        "(LlamaForCausalLM or GPT2LMHeadModel)")
    return parser


def _export_target(to: Path) -> None:
    """Refuse an ``export --to`` that cannot be written, before the checkpoint is read and assembled."""
    if to.suffix != ".safetensors":
        raise ConfigError(f"export --to {to}: export writes a safetensors file, so name it "
                          f"{to.with_suffix('.safetensors')}")
    if to.is_dir():
        raise ConfigError(f"export --to {to} is a directory; name the .safetensors file to write")
    if not to.parent.is_dir():
        raise ConfigError(f"export --to {to}: directory {to.parent} does not exist; create it first")
    if not os.access(to.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"export --to {to}: directory {to.parent} is not writable; choose another place")


def _export_hf_target(out: Path) -> None:
    """Refuse an ``export --hf`` directory that cannot be written or already holds a model."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export --hf {out} is a file; name the directory to write the model to")
    if any((out / name).exists() for name in (hf.CONFIG, hf.WEIGHTS, hf.INDEX)):
        raise ConfigError(f"export --hf {out} already holds a model; choose an empty or new directory")
    if not out.parent.is_dir():
        raise ConfigError(f"export --hf {out}: directory {out.parent} does not exist; create it first")
    if not os.access(out if out.exists() else out.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"export --hf {out}: not writable; choose another place")


def _export(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    to = Path(args.hf or args.to)
    if args.hf:
        _export_hf_target(to)
    else:
        _export_target(to)
    try:
        print(export_hf(Path(args.checkpoint), to) if args.hf else export(Path(args.checkpoint), to))
    except OSError as e:
        raise ConfigError(f"exporting {args.checkpoint} to {to} failed: {e}") from None
    return 0


def _add_launch_parser(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser("launch", help="run a Python training script as N local ranks",
                            description="Run SCRIPT ARGS as N local ranks, each with the environment torchrun "
                                        "gives (RANK, WORLD_SIZE, ...; trainmesh.init_mesh reads it), a rendezvous "
                                        "on 127.0.0.1 only, and every rank stopped as soon as one fails, the "
                                        "failing rank named with its traceback. Rank 0's output is shown.")
    launch.add_argument("--nproc", default="1", metavar="N", help="ranks to start (default: 1)")
    launch.add_argument("script", help="the Python file to run on every rank")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to the script")


def _launch(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.launcher import launch

    nproc = check_value("nproc", parse_flag("nproc", args.nproc), written=args.nproc)
    limit = max(8, 4 * (os.cpu_count() or 1)) if not _cuda_devices() else _cuda_devices()
    if nproc > limit:
        raise ConfigError(f"--nproc {nproc} is more local ranks than this machine can run (limit {limit}); use "
                          f"torchrun across machines for more")
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"launch: script {script} does not exist or is not a file")
    return launch(args.args, nproc, program=(str(script),))


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from trainmesh.plan import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="predict memory and step time of every layout; pick the best",
                                      description="Predict, before launching, which layouts fit in memory and "
                                                  "which is fastest (no ranks are started)."))


def _plan(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.plan import plan_from_args

    try:
        print(plan_from_args(args))
    except ValueError as e:
        print(f"trainmesh: error: {e}", file=sys.stderr)
        return 2
    return 0


def _add_schedule_parser(sub: argparse._SubParsersAction) -> None:
    from trainmesh.pipeline.schedules import SCHEDULES

    schedule = sub.add_parser("schedule", help="print and draw a pipeline schedule, simulated",
                              description="Print each pipeline rank's actions, busy/idle time and peak "
                                          "activations under a schedule, and draw its timeline.")
    schedule.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: 4)")
    schedule.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default: 8)")
    schedule.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="default: 1f1b")
    schedule.add_argument("--virtual", type=int, default=1, help="model chunks per rank, interleaved only "
                          "(default: 1)")
    schedule.add_argument("--png", help="draw the timeline (ranks x time, coloured by action) to this file")


def _schedule(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.pipeline.draw import schedule_command

    try:
        print(schedule_command(args.pp, args.microbatches, args.schedule, args.virtual, args.png))
    except (ValueError, ImportError) as e:
        print(f"trainmesh: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _is_rank() -> bool:
    return world_env().is_rank


def _world_from_env() -> int | None:
    """The world size as torchrun (or the launcher: ``WORLD_SIZE``) or srun (``SLURM_NTASKS``) set it,
    checked like ``--nproc`` before anything parses it; None when this process is not a rank."""
    name = "WORLD_SIZE" if "RANK" in os.environ else "SLURM_NTASKS" if "SLURM_PROCID" in os.environ else ""
    if not name:
        return None
    text = os.environ.get(name, "1")
    world = check_value("nproc", parse_flag("nproc", text), f"environment {name}", written=text)
    return world if _is_rank() else None


def checked_config(args: argparse.Namespace) -> Config:
    """The configuration, validated against this process's world (or the one about to be spawned)."""
    cfg = config_from_args(args)
    world = _world_from_env()
    if cfg.plan == "auto":
        cfg = _planned(cfg, world or cfg.nproc)
    validate(cfg, world_size=world, cuda_devices=_cuda_devices())
    if not _is_rank():
        TokenData.load(cfg.data, cfg.model_config.seq_len)
        check_resumable(cfg)
    return cfg


def _planned(cfg: Config, world: int) -> Config:
    """``--plan auto``: the planner's fastest layout that fits this world and validates; rank 0 prints it."""
    from trainmesh.plan import plan_config

    try:
        cfg, line = plan_config(cfg, world, _cuda_devices())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if world_from_env()[0] == 0:
        print(line, flush=True)
    return cfg


def _with_out_dir(argv: Sequence[str], cfg: Config) -> tuple[list[str], Config]:
    """Fix the run directory before spawning so every rank (and the user) agrees on it."""
    if cfg.out:
        return list(argv), cfg
    out = default_out_dir()
    return [*argv, "--out", out], dataclasses.replace(cfg, out=out)


def _owns_run_dirs() -> bool:
    """Whether this process checks and locks the run's directories and claims the checkpoint directory:
    the command the user started (which spawns the ranks, or is the only one), or rank 0 under torchrun;
    never a rank this CLI spawned."""
    return not _is_rank() or (world_env().rank == 0 and os.environ.get(STORE_CLIENT_ENV) != "1")


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    cfg = checked_config(args)
    if not _owns_run_dirs():
        return _train_here(cfg)
    if not _is_rank():
        argv, cfg = _with_out_dir(argv, cfg)
    check_run_dirs(cfg)
    with claim(cfg), runlock.hold(Path(cfg.out), "--out") if cfg.out else contextlib.nullcontext():
        if not _is_rank() and (cfg.nproc > 1 or cfg.max_restarts):
            from trainmesh.launcher import launch_with_restarts
            from trainmesh.train import FAULT_ENV

            if cfg.plan == "auto":
                from trainmesh.plan import layout_flags

                argv = [*argv, *layout_flags(cfg)]
            return launch_with_restarts(argv, cfg.nproc, cfg.max_restarts, clear_on_restart=(FAULT_ENV,))
        return _train_here(cfg)


def _train_here(cfg: Config) -> int:
    """Train as one rank in this process (the only one, or one of many under torchrun or the launcher)."""
    from trainmesh.mesh import shutdown_distributed
    from trainmesh.train import RunStopped, train

    try:
        train(cfg)
    except RunStopped:
        return 0  # another rank failed and reports it; this one only stopped with it
    shutdown_distributed()
    return 0


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.form == "all":
        from trainmesh.bench.suite import run_all

        cfg = config_from_args(args)
        return run_all(cfg.nproc, cfg.model, cfg.global_batch, args.rounds, args.steps_per_round,
                       cfg.out or default_out_dir())
    cfg = checked_config(args)
    if not _is_rank() and cfg.nproc > 1:
        from trainmesh.launcher import launch

        return launch(argv, cfg.nproc)
    from trainmesh.bench.common import write_results
    from trainmesh.bench.dp import bench_dp
    from trainmesh.bench.pp import bench_pp
    from trainmesh.bench.tp import bench_tp
    from trainmesh.bench.zero import bench_zero
    from trainmesh.mesh import shutdown_distributed

    bench_form = {"dp": bench_dp, "zero": bench_zero, "pp": bench_pp, "tp": bench_tp}[args.form]
    write_results(bench_form(cfg, rounds=args.rounds, steps_per_round=args.steps_per_round), args.results)
    shutdown_distributed()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        commands = {"train": _train, "bench": _bench, "schedule": _schedule, "plan": _plan, "export": _export,
                    "launch": _launch}
        return commands[args.command](args, argv)
    except (ConfigError, DataError, CheckpointError, runlock.DirectoryInUse, MetricsError) as e:
        print(f"trainmesh: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
