"""One typed run configuration: defaults, then a TOML file, then command-line flags.

Every field carries its help text, so ``trainmesh train --help`` documents every flag and a TOML file uses
the same names (``global_batch = 32``). :func:`validate` rejects impossible layouts with one line that says
how to fix them, before any rank is spawned.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainmesh.models import PRESET_NAMES, preset, spec_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class Config:
    # model and data
    model: str = _opt("tiny", "model preset (GPT: tiny, small, ...; Llama: llama-tiny, llama-small)", PRESET_NAMES)
    data: str = _opt("", "text file or directory to train on (default: this Python's standard library sources)")
    seed: int = _opt(0, "seed for weights, data order and dropout")
    # layout
    nproc: int = _opt(1, "local ranks to spawn (ignored under torchrun, which sets WORLD_SIZE)")
    dp: int = _opt(1, "data-parallel degree")
    tp: int = _opt(1, "tensor-parallel degree")
    sequence_parallel: bool = _opt(False, "sequence parallelism over tp: LayerNorm regions split along the "
                                   "sequence, all-gather/reduce-scatter in place of all-reduce (needs --tp > 1)")
    pp: int = _opt(1, "pipeline-parallel degree")
    plan: str = _opt("", "auto: run the fastest layout the planner (trainmesh plan) predicts to fit this world "
                     "(--nproc, or WORLD_SIZE under torchrun), in place of --dp/--tp/--pp/--zero/--microbatches/"
                     "--schedule/--virtual-stages/--recompute/--sequence-parallel", ("", "auto"))
    # pipeline (used when pp > 1)
    schedule: str = _opt("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved (1F1B over --virtual-stages "
                         "chunks per rank) or zb (zero-bubble ZB-H1)", ("gpipe", "1f1b", "interleaved", "zb"))
    virtual_stages: int = _opt(1, "model chunks per pipeline rank (interleaved schedule)")
    stage_layers: str = _opt("", "layers of each pipeline stage in model order, comma-separated (one per "
                             "stage, pp * virtual-stages of them), e.g. 1,3; default: balanced by parameter count")
    timeline: str = _opt("", "draw the last step's measured pipeline timeline (ranks x time) to this PNG")
    zero: int = _opt(0, "ZeRO stage on the data-parallel axis", (0, 1, 2, 3))
    bucket_mb: float = _opt(25.0, "gradient bucket size in MB for the data-parallel AllReduce")
    precision: str = _opt("fp32", "parameter and compute dtype; bf16/fp16 keep fp32 master weights and optimizer "
                          "state (fp16 with dynamic loss scaling); fp64 for exact equivalence checks",
                          ("fp32", "bf16", "fp16", "fp64"))
    recompute: str = _opt("none", "activation recomputation: full (each block) or selective (attention core)",
                          ("none", "selective", "full"))
    reduce_dtype: str = _opt("auto", "dtype gradients are accumulated and reduced in (auto: fp32, or fp64 under "
                             "--precision fp64)", ("auto", "fp32", "bf16", "fp16", "fp64"))
    # optimisation
    steps: int = _opt(50, "optimizer steps")
    global_batch: int = _opt(16, "sequences per optimizer step, over all data-parallel ranks")
    microbatches: int = _opt(1, "micro-batches per step on each data-parallel rank (gradient accumulation)")
    lr: float = _opt(3e-3, "peak learning rate")
    min_lr: float = _opt(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _opt(5, "linear warm-up steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay (not applied to biases and norms)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip gradients to this global L2 norm (0 disables)")
    eval_every: int = _opt(0, "evaluate the validation loss every K steps (0: only at the end)")
    eval_batches: int = _opt(2, "global batches per evaluation")
    # checkpoints
    checkpoint_dir: str = _opt("", "directory of sharded checkpoints (step-N subdirectories and a 'latest' "
                               "pointer), saved every --checkpoint-every steps and at the end")
    checkpoint_every: int = _opt(0, "save a checkpoint every K steps (0: only at the end); needs --checkpoint-dir")
    resume: bool = _opt(False, "continue from the latest complete checkpoint in --checkpoint-dir, in any layout "
                        "(an earlier one if it is damaged; step 0 if there is none)")
    init_from: str = _opt("", "start from the weights of a plain .safetensors model file (as 'trainmesh export' "
                          "writes) with a fresh optimizer")
    max_restarts: int = _opt(0, "after a rank fails, restart all ranks from the latest complete checkpoint up to "
                             "R times; needs --checkpoint-dir")
    # runtime
    backend: str = _opt("auto", "process-group backend: auto picks nccl with CUDA, else gloo",
                        ("auto", "gloo", "nccl", "mpi"))
    device: str = _opt("auto", "device: auto picks cuda when present", ("auto", "cpu", "cuda"))
    compile: bool = _opt(False, "torch.compile each transformer block")
    collective_timeout: float = _opt(600.0, "seconds a collective may wait before the run is stopped with a "
                                     "report of which rank(s) did not arrive")
    debug_collectives: bool = _opt(False, "check every collective's op and shapes across ranks "
                                   "(TORCH_DISTRIBUTED_DEBUG=DETAIL; slow, for debugging)")
    max_bad_steps: int = _opt(5, "stop after this many consecutive steps with a non-finite loss or gradient")
    peak_tflops: float = _opt(0.0, "per-device peak TFLOP/s for MFU (default: looked up from the GPU name)")
    out: str = _opt("", "run directory for metrics.jsonl and summary.json (default: runs/<timestamp>)")
    progress: bool = _opt(True, "print a progress line per step on rank 0")

    @property
    def model_config(self) -> Any:
        """The preset's config, of its family's type (``models.gpt.ModelConfig``, ``models.llama.LlamaConfig``)."""
        return preset(self.model)

    @property
    def stage_layer_counts(self) -> tuple[int, ...]:
        """``--stage-layers`` as numbers; empty when the pipeline balances stages itself."""
        try:
            return tuple(int(c) for c in self.stage_layers.split(",")) if self.stage_layers else ()
        except ValueError:
            raise ConfigError(f"--stage-layers {self.stage_layers!r} is not a comma-separated list of layer "
                              f"counts; write e.g. 1,3") from None

    @property
    def grad_dtype(self) -> str:
        """``reduce_dtype`` resolved: gradients are never reduced in less than fp32 unless asked for."""
        if self.reduce_dtype != "auto":
            return self.reduce_dtype
        return "fp64" if self.precision == "fp64" else "fp32"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def micro_batch(self) -> int:
        """Sequences in one micro-batch on one data-parallel rank."""
        return self.global_batch // (self.dp * self.microbatches)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`Config` field; defaults are suppressed so only flags given on the line count."""
    parser.add_argument("--config", metavar="TOML", help="TOML file of settings (flags override it)")
    for f in fields(Config):
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
            continue
        py_type = {"int": int, "float": float, "str": str}[str(f.type)]
        parser.add_argument(_flag(f.name), type=py_type, choices=f.metadata["choices"], help=help_text, **kwargs)


def load_toml(path: str) -> dict[str, Any]:
    """Read a flat or sectioned TOML file into Config field values; unknown keys are an error."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(unknown)}; valid keys are the flag names")
    return flat


def config_from_args(args: argparse.Namespace) -> Config:
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    values.update({f.name: getattr(args, f.name) for f in fields(Config) if hasattr(args, f.name)})
    try:
        return Config(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def validate(cfg: Config, world_size: int | None = None, cuda_devices: int = 0) -> None:
    """Raise :class:`ConfigError` for any setting that cannot run, with the fix in the message."""
    try:
        spec_of(cfg.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in ("nproc", "dp", "tp", "pp", "steps", "global_batch", "microbatches", "eval_batches"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    world = cfg.nproc if world_size is None else world_size
    if world != cfg.world_size:
        raise ConfigError(
            f"world size {world} != dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp} = {cfg.world_size}; "
            f"set --nproc {cfg.world_size} or change --dp/--tp/--pp so their product is {world}")
    limit = cuda_devices if cfg.device == "cuda" else max(8, 4 * (os.cpu_count() or 1))
    if world_size is None and cfg.nproc > limit:
        where = f"{cuda_devices} CUDA device(s)" if cfg.device == "cuda" else f"{os.cpu_count()} CPU core(s)"
        raise ConfigError(f"--nproc {cfg.nproc} is more local ranks than this machine's {where} can run "
                          f"(limit {limit}); use torchrun across machines for more")
    per_step = cfg.dp * cfg.microbatches
    if cfg.global_batch % per_step:
        raise ConfigError(
            f"--global-batch {cfg.global_batch} is not divisible by dp*microbatches = {per_step}; "
            f"use a multiple of {per_step}, e.g. {per_step * max(1, round(cfg.global_batch / per_step))}")
    if cfg.backend == "nccl" and not cuda_devices:
        raise ConfigError("--backend nccl needs CUDA devices and none is visible; use --backend gloo")
    if cfg.device == "cuda" and not cuda_devices:
        raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu")
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.min_lr > cfg.lr:
        raise ConfigError(f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={cfg.lr} min_lr={cfg.min_lr}")
    _validate_model_split(cfg)
    _validate_pipeline(cfg)
    _validate_checkpoints(cfg)


def _validate_checkpoints(cfg: Config) -> None:
    for name in ("checkpoint_every", "max_restarts"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(cfg, name)}")
    needs_dir = [flag for flag, given in (("--resume", cfg.resume), ("--checkpoint-every", cfg.checkpoint_every),
                                          ("--max-restarts", cfg.max_restarts)) if given]
    if needs_dir and not cfg.checkpoint_dir:
        raise ConfigError(f"{needs_dir[0]} works on checkpoints; set --checkpoint-dir DIR")


def _validate_model_split(cfg: Config) -> None:
    m = cfg.model_config
    if cfg.pp > m.n_layers:
        raise ConfigError(f"--pp {cfg.pp} exceeds the {m.n_layers} layers of {cfg.model}; "
                          f"choose pp <= {m.n_layers}")
    problem = spec_of(cfg.model).shape(m).split_error(cfg.tp, cfg.pp, cfg.model)
    if problem:
        raise ConfigError(problem)
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence over tensor-parallel ranks; "
                          "set --tp > 1 or drop --sequence-parallel")
    if cfg.sequence_parallel and m.seq_len % cfg.tp:
        raise ConfigError(f"--sequence-parallel needs tp={cfg.tp} to divide seq_len={m.seq_len} of {cfg.model}; "
                          f"choose tp dividing {m.seq_len} or drop --sequence-parallel")


def _validate_pipeline(cfg: Config) -> None:
    """Pipeline settings that cannot run (schedules: Narayanan et al. 2021; Qi et al. 2023)."""
    p, v, m, n_layers = cfg.pp, cfg.virtual_stages, cfg.microbatches, cfg.model_config.n_layers
    if v < 1:
        raise ConfigError(f"--virtual-stages must be at least 1, got {v}")
    if p == 1:
        for flag, given in (("--virtual-stages", v > 1), ("--stage-layers", cfg.stage_layers),
                            ("--timeline", cfg.timeline)):
            if given:
                raise ConfigError(f"{flag} is a pipeline setting and --pp is 1; set --pp > 1 or drop {flag}")
        return
    if v > 1 and cfg.schedule != "interleaved":
        raise ConfigError(f"--virtual-stages {v} needs --schedule interleaved ({cfg.schedule} holds one stage "
                          f"per rank); use --schedule interleaved or --virtual-stages 1")
    if cfg.schedule == "interleaved" and m % p:
        raise ConfigError(f"--schedule interleaved sends micro-batches through the chunks in groups of pp={p}; "
                          f"set --microbatches to a multiple of {p} (got {m})")
    if n_layers < p * v:
        raise ConfigError(f"--pp {p} x --virtual-stages {v} = {p * v} stages need at least one layer each, but "
                          f"{cfg.model} has {n_layers}; choose pp * virtual-stages <= {n_layers}")
    counts = cfg.stage_layer_counts
    if counts and (len(counts) != p * v or min(counts) < 1 or sum(counts) != n_layers):
        raise ConfigError(f"--stage-layers {cfg.stage_layers} must give {p * v} counts (pp * virtual-stages), "
                          f"each >= 1, summing to the {n_layers} layers of {cfg.model}")
    if cfg.schedule == "zb" and cfg.compile:
        raise ConfigError("--schedule zb splits backward at module outputs, which torch.compile fuses away; "
                          "drop --compile or use --schedule 1f1b")
