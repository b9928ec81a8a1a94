"""One typed run configuration: defaults, then a TOML file, then command-line flags.

Each section of a :class:`Config` is one TOML table and one ``--help`` group, each field carries its help
text; :func:`validate` rejects impossible layouts in one line before any rank is spawned."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from collections.abc import Callable, Collection
from typing import Any

import torch

from trainmesh.models import hf
from trainmesh.data import data_vocab_size, is_prepared
from trainmesh.distributed.launcher import STOPPED_GRACE_S
from trainmesh.distributed.heartbeat import PEER_TIMEOUT_S
from trainmesh.layout import (ABOVE_0, AT_LEAST_0, AT_LEAST_1, MAX_RANKS, MAX_SEQUENCES, Bound, Layout, LayoutError,
                              option, outside, range_text, resolve_precision)
from trainmesh.training.float8 import fp8_problem
from trainmesh.layout import flag as flag_spelling, validate as validate_layout
from trainmesh.models import PRESET_NAMES, preset, spec_of
from trainmesh.models.moe import MoEConfig
from trainmesh.storage.safe_io import UnreadableFile, read_user_file
from trainmesh.distributed.shm import TRANSPORTS
from trainmesh.data.tokenizer import BYTE_VOCAB, padded_vocab

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


INT64_LIMIT = 2**63  # ints reach int64 tensors (seeds, step counters): every int field stays below it


MAX_STEPS = Bound(10**9)
"""Step counts (``--steps``, ``--warmup-steps``, the ``--*-every`` intervals): a billion. The data never runs
out (each step draws its batch at random from the whole split), so the bound is stated, not derived: at
the fastest step trainmesh takes (~1 ms) a billion steps is 11 days, at a typical 10-100 ms months to years,
so a larger count is a typo that would otherwise be accepted with an ETA of centuries. Evaluation batches
are drawn as the steps from a billion on (``train.EVAL_STEP_BASE``), which training never reaches."""
MAX_SEQ_LEN = Bound(1 << 20)  # tokens per sequence: position and rotary tables are sized to it
MAX_EXPERTS = Bound(1 << 16)  # routed experts per layer (DeepSeek-V3 has 256)
MAX_COEF = Bound(1000)  # loss weights and capacity factors: larger only drowns the language-model loss
MAX_LR = Bound(10)  # AdamW's step is about lr per parameter: above 10 every weight leaves its scale at once
MAX_SECONDS = Bound(7 * 24 * 3600)  # timeouts and grace periods: a week; beyond it a hang is never reported
EVAL_BATCHES_FLOOR = 100  # --eval-batches allowed on any data, however small its validation split


@dataclass(frozen=True)
class ModelSettings:
    """The model: its preset, seed and sequence length."""

    model: str = option("tiny", "model preset (GPT: tiny, small, ...; Llama: llama-tiny, llama-small; "
                        "mixtures of experts: moe-tiny, llama-moe-tiny)", PRESET_NAMES)
    seed: int = option(0, "seed for weights, data order and dropout", low=AT_LEAST_0, high=Bound(2**63 - 1))
    seq_len: int = option(0, "tokens per sequence, overriding the preset's (a learned position table is sized to "
                          "it); 0: the preset's", low=AT_LEAST_0, high=MAX_SEQ_LEN)


@dataclass(frozen=True)
class MoESettings:
    """Mixture-of-experts models (moe-tiny, llama-moe-tiny, a Mixtral through --init-hf): the preset's experts
    and routing, overridden."""

    moe_experts: int = option(0, "routed experts per MoE layer, overriding the preset's (0: the preset's)",
                              low=AT_LEAST_0, high=MAX_EXPERTS)
    moe_top_k: int = option(0, "experts each token is routed to, overriding the preset's (0: the preset's)",
                            low=AT_LEAST_0, high=MAX_EXPERTS)
    moe_dense_layers: int = option(0, "leading layers that keep a dense MLP, the rest mixtures of experts "
                                   "(DeepSeek-V3's first_k_dense_replace), overriding the preset's (0: the preset's; "
                                   "moe-tiny has none, deepseek-v3-tiny 1)", low=AT_LEAST_0, high=Bound(1 << 12))
    moe_dropless: bool = option(True, "route every token to its top-k experts however uneven the load; "
                                "--no-moe-dropless with --moe-capacity drops the copies beyond each expert's capacity")
    moe_capacity: float = option(0.0, "capacity factor under --no-moe-dropless: each expert takes at most "
                                 "ceil(F * tokens * top-k / experts) token copies per micro-batch, first come first "
                                 "served (GShard); the dropped fraction is logged", low=AT_LEAST_0, high=MAX_COEF)
    moe_aux_coef: float = option(0.01, "weight of the load-balancing loss (per-sequence Switch/GShard form, 1 "
                                 "when balanced)", low=AT_LEAST_0, high=MAX_COEF)
    moe_z_coef: float = option(0.001, "weight of the router z-loss (ST-MoE)", low=AT_LEAST_0, high=MAX_COEF)
    moe_bias_rate: float = option(0.0, "auxiliary-loss-free balancing (DeepSeek-V3): after each step move every "
                                  "expert's routing bias by this much towards the mean load (0: off)", low=AT_LEAST_0,
                                  high=Bound(1))


@dataclass(frozen=True)
class DataSettings:
    """What the model reads: the data and its tokenizer."""

    data: str = option("", "text file or directory to train on (default: this Python's standard library sources), "
                       "or a directory of token shards written by 'trainmesh prepare' (memory-mapped)")
    tokenizer: str = option("", "tokenizer.json (Hugging Face) for text data; the model's vocabulary follows it, "
                            "padded to a multiple of 64*tp (default: bytes, the preset's vocabulary; prepared "
                            "data carries its own, and a --tokenizer given with it must be the same one); checkpoints record it and its SHA-256")
    document_mask: bool = option(False, "confine attention to each document of a window and restart positions at each "
                                 "(documents end at the end-of-document token 'trainmesh prepare' writes; needs "
                                 "prepared --data)")


@dataclass(frozen=True)
class OptimSettings:
    """Optimisation and evaluation: the steps, the batch, AdamW and the guard against non-finite steps."""

    steps: int = option(50, "optimizer steps; at most a billion, a stated bound (each step draws its batch at random "
                        "from the whole data, so the data never runs out; a larger count is a typo)", low=AT_LEAST_1,
                        high=MAX_STEPS)
    global_batch: int = option(16, "sequences per optimizer step, over all data-parallel ranks", low=AT_LEAST_1,
                               high=MAX_SEQUENCES)
    lr: float = option(3e-3, "peak learning rate", low=ABOVE_0, high=MAX_LR)
    min_lr: float = option(3e-4, "learning rate at the end of the cosine decay", low=AT_LEAST_0, high=MAX_LR)
    warmup_steps: int = option(5, "linear warm-up steps", low=AT_LEAST_0, high=MAX_STEPS)
    weight_decay: float = option(0.1, "AdamW weight decay (not applied to biases and norms)", low=AT_LEAST_0,
                                 high=Bound(100))
    beta1: float = option(0.9, "AdamW beta1", low=AT_LEAST_0, high=Bound(1, strict=True))
    beta2: float = option(0.95, "AdamW beta2", low=AT_LEAST_0, high=Bound(1, strict=True))
    grad_clip: float = option(1.0, "clip gradients to this global L2 norm (0 disables)", low=AT_LEAST_0,
                              high=Bound(1e9))
    eval_every: int = option(0, "evaluate the validation loss every K steps (0: only at the end)", low=AT_LEAST_0,
                             high=MAX_STEPS)
    eval_batches: int = option(2, "global batches per evaluation; at most those that cover the validation split "
                               f"about once, or {EVAL_BATCHES_FLOOR} on a small one (more only redraws the same windows)",
                               low=AT_LEAST_1, high=MAX_SEQUENCES)
    max_bad_steps: int = option(5, "stop after this many consecutive steps with a non-finite loss or gradient",
                                low=AT_LEAST_1, high=MAX_STEPS)


@dataclass(frozen=True)
class CheckpointSettings:
    """Saving, resuming and the starting weights."""

    checkpoint_dir: str = option("", "directory of sharded checkpoints (step-N subdirectories and a 'latest' "
                                 "pointer), saved every --checkpoint-every steps and at the end")
    checkpoint_every: int = option(0, "save a checkpoint every K steps (0: only at the end); needs --checkpoint-dir",
                                   low=AT_LEAST_0, high=MAX_STEPS)
    keep_last: int = option(3, "keep the K newest checkpoints, deleting older ones (oldest first) once a new one is "
                            "complete; never the one 'latest' names (0: keep all)", low=AT_LEAST_0, high=MAX_STEPS)
    checkpoint_async: bool = option(False, "copy each checkpoint to host memory and write it in the background while "
                                    "training goes on; 'latest' moves once every rank's part is durable, the run's "
                                    "end waits for the last save, and the summary gives each save's stall and write time")
    memory_snapshot: str = option("off", "keep each rank's latest state in its node's memory (/dev/shm) and a copy "
                                  "on another node's, for --resume to restart from (falling back to disk when both "
                                  "copies are gone): every-step, or auto (every N steps, N keeping the measured "
                                  "cost near a tenth of the training time)", ("off", "auto", "every-step"))
    resume: bool = option(False, "continue from the latest complete checkpoint in --checkpoint-dir, in any layout "
                          "(an earlier one if it is damaged; step 0 if there is none)")
    init_from: str = option("", "start from the weights of a plain .safetensors model file (as 'trainmesh export' "
                            "writes) with a fresh optimizer")
    init_hf: str = option("", "start from a local Hugging Face model directory (config.json and model.safetensors, "
                          "as save_pretrained writes; never a hub id, nothing is downloaded) with a fresh optimizer; "
                          "the model's family and shape come from its config.json, so --model is not needed")
    overwrite: bool = option(False, "start a fresh run where another run left its checkpoints (--checkpoint-dir) or "
                             "its records (metrics, summary, report, TensorBoard events in --out), deleting them "
                             "first (without it such a directory is refused)")


@dataclass(frozen=True)
class LoggingSettings:
    """What a run records and shows: its run directory, progress, trackers and profiles."""

    out: str = option("", "run directory for metrics.jsonl, summary.json and TensorBoard events (default: "
                      "runs/<timestamp>); 'trainmesh report DIR' plots it")
    progress: bool = option(True, "show training progress on rank 0: one bar redrawn in place on a terminal, else "
                            "a line every --progress-every steps (the start line, checkpoint notices and the final "
                            "summary print either way)")
    progress_every: int = option(0, "steps between progress lines when output is not a terminal (0: a twentieth "
                                 "of --steps)", low=AT_LEAST_0, high=MAX_STEPS)
    tensorboard: bool = option(True, "write TensorBoard event files to --out (tensorboard --logdir DIR) when the "
                               "tensorboard package is installed")
    wandb: str = option("", "also log to this Weights & Biases project (needs the wandb package); offline under "
                        "--out unless WANDB_MODE=online; runs are grouped by layout and precision, and a resumed "
                        "run continues its W&B run")
    profile_steps: int = option(0, "trace the last K steps with torch.profiler: each rank writes profile/rank<R>.json "
                                "under --out (Perfetto or chrome://tracing opens it) and rank 0 prints the ops that "
                                "took the most time and, on a GPU, how busy the device was; profiled steps run slower",
                                low=AT_LEAST_0, high=Bound(10_000))
    peak_tflops: float = option(0.0, "per-device peak TFLOP/s for MFU (default: looked up from the GPU name)",
                                low=AT_LEAST_0, high=Bound(1e6))
    tee: str = option("0", "ranks whose output is streamed here, comma-separated (0,1) or all; each line then starts "
                      "[rank N] (rank 0 alone streams unprefixed). Every rank's stdout and stderr are also kept in "
                      "--out's logs/rank-N.log")


@dataclass(frozen=True)
class LaunchSettings:
    """How the ranks are started and watched: their number, the backend and device, timeouts and restarts."""

    nproc: int = option(1, "local ranks to spawn (ignored under torchrun, which sets WORLD_SIZE)", low=AT_LEAST_1,
                        high=MAX_RANKS)
    elastic: bool = option(False, "under torchrun's elastic agent (--nnodes MIN:MAX, with --resume): run on the "
                           "world torchrun gives, scaling --dp (and --dp-replicate, keeping each group's size) to it")
    plan: str = option("", "auto: run the fastest layout the planner (trainmesh plan) predicts to fit this world "
                       "(--nproc, or WORLD_SIZE under torchrun), in place of --dp/--cp/--cp-impl/--tp/--pp/--zero/--microbatches/"
                       "--schedule/--virtual-stages/--recompute/--sequence-parallel", ("", "auto"))
    backend: str = option("auto", "process-group backend: auto picks nccl with CUDA, else gloo",
                          ("auto", "gloo", "nccl", "mpi"))
    device: str = option("auto", "device: auto picks cuda when present", ("auto", "cpu", "cuda"))
    collective_timeout: float = option(600.0, "seconds a collective may wait before the run is stopped with a "
                                       "report of which rank(s) did not arrive; from 1 s (below it, start-up and "
                                       "scheduling delays fail healthy runs) to a week", low=AT_LEAST_1,
                                       high=MAX_SECONDS)
    debug_collectives: bool = option(False, "check every collective's op and shapes across ranks "
                                     "(TORCH_DISTRIBUTED_DEBUG=DETAIL; slow, for debugging)")
    stopped_grace: float = option(STOPPED_GRACE_S, "seconds a rank the launcher started (--nproc > 1 or "
                                  "--max-restarts) may stay stopped (SIGSTOP, a debugger's halt) before the job ends; "
                                  "the launcher warns, naming the rank and its pid, within a second of the stop; from "
                                  "1 s to a week", low=AT_LEAST_1, high=MAX_SECONDS)
    peer_timeout: float = option(PEER_TIMEOUT_S, "seconds after which a rank declares a peer lost, ending itself "
                                 "with one line naming it so the launcher or elastic agent restarts: a peer whose "
                                 "heartbeat stopped (dead, frozen; a stop under trainmesh's launcher is left to "
                                 "--stopped-grace), or one that made no progress outside any collective while this "
                                 "rank waited on it; above any stretch of compute between two collectives; from 1 s "
                                 "to a week", low=AT_LEAST_1, high=MAX_SECONDS)
    host_transport: str = option("auto", "how the ranks of one CPU host exchange: auto sums, gathers and passes "
                                 "pipeline messages through shared memory (trainmesh.distributed.shm) where an axis's ranks share "
                                 "the host; off sends every collective and message through torch.distributed, the "
                                 "path NCCL runs on GPUs (TRAINMESH_HOST_TRANSPORT=off in the environment does the "
                                 "same). auto is the default because it is faster on one host, 1.2x to 1.9x on "
                                 "small models (docs/performance.md); the run's summary.json records which was used",
                                 TRANSPORTS)
    max_restarts: int = option(0, "after a rank fails, restart all ranks from the latest complete checkpoint up to "
                               "R times; needs --checkpoint-dir", low=AT_LEAST_0, high=Bound(1000))
    lighthouse: str = option("", "run as one replica group of the torchft job whose lighthouse is at this address "
                             "(http://HOST:PORT): the groups left train on while one is lost, and a group started "
                             "again copies a live group's state (needs the ft extra; docs/multinode.md)")
    replica_group: int = option(0, "this run's replica group under --lighthouse (0, 1, ...): it reads batches of its "
                                "own, drawn with --seed plus the group", low=AT_LEAST_0, high=Bound(10_000))
    replica_timeout: float = option(60.0, "seconds the replica groups under --lighthouse wait for each other (the "
                                    "quorum, the gradient all-reduce, a heal's transfer): a frozen group holds the "
                                    "others this long before they go on without it (a killed one, a step)",
                                    low=AT_LEAST_1, high=MAX_SECONDS)


@dataclass(frozen=True)
class Config:
    """A ``trainmesh train`` run: one section per TOML table and ``--help`` group (``cfg.optim.lr`` is ``[optim]
    lr``), each field one flag; :meth:`from_settings` builds one from the flag names, underscored."""

    model: ModelSettings = field(default_factory=ModelSettings)
    moe: MoESettings = field(default_factory=MoESettings)
    data: DataSettings = field(default_factory=DataSettings)
    layout: Layout = field(default_factory=Layout)
    optim: OptimSettings = field(default_factory=OptimSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    launch: LaunchSettings = field(default_factory=LaunchSettings)

    @classmethod
    def from_settings(cls, **settings: Any) -> Config:
        """The run the flat ``settings`` give (the rest the defaults), ``--precision auto`` resolved for this
        machine; an unknown name is a :class:`ConfigError`."""
        unknown = sorted(settings.keys() - TABLE_OF.keys())
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]}; settings are the flag names (trainmesh train --help)")
        if settings.get("precision", "auto") == "auto":
            settings = {**settings, "precision": resolve_precision("auto", _bf16_device(settings.get("device", "auto")))}
        return cls(**{table: section(**{name: value for name, value in settings.items() if TABLE_OF[name] == table})
                      for table, section in SECTIONS.items()})

    def replace(self, **settings: Any) -> Config:
        """This run with the flat ``settings`` changed."""
        return Config.from_settings(**{**self.settings(), **settings})

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name, as manifests, ``summary.json`` and the ranks' handed run record it."""
        return {name: getattr(getattr(self, table), name) for name, table in TABLE_OF.items()}

    @property
    def model_config(self) -> Any:
        """The preset's config, of its family's type (``models.gpt.ModelConfig``, ``models.llama.LlamaConfig``);
        with ``--init-hf``, the one its ``config.json`` describes (``model`` then names a preset of that family).
        A preset's vocabulary follows the data's tokenizer when it has one (padded,
        :func:`trainmesh.data.tokenizer.padded_vocab`); a Hugging Face model keeps its own. ``--seq-len`` replaces
        the sequence length."""
        if self.checkpoint.init_hf:
            base = hf.read_config(self.checkpoint.init_hf)[1]
        else:
            vocab = data_vocab_size(self.data.data, self.data.tokenizer)
            base = preset(self.model.model)
            base = base if vocab is None else dataclasses.replace(base, vocab_size=padded_vocab(vocab, self.layout.tp))
        if getattr(base, "moe", None) is not None:
            base = dataclasses.replace(base, moe=self._moe_config(base.moe, base.n_layers))
        return dataclasses.replace(base, seq_len=self.model.seq_len) if self.model.seq_len else base

    def _moe_config(self, moe: MoEConfig, n_layers: int) -> MoEConfig:
        """The model's MoE layers with the ``--moe-*`` settings; one line naming the flag if they cannot run."""
        s = self.moe
        experts, top_k = s.moe_experts or moe.n_experts, s.moe_top_k or moe.top_k
        if s.moe_dense_layers >= n_layers:
            raise ConfigError(f"--moe-dense-layers {s.moe_dense_layers} leaves no mixture-of-experts layer among "
                              f"the {n_layers} layers of {_model_name(self)}; choose --moe-dense-layers below "
                              f"{n_layers}, or a dense model")
        if top_k > experts:
            raise ConfigError(f"--moe-top-k {top_k} exceeds the {experts} experts per layer of {self.model.model}; "
                              f"choose --moe-top-k in 1..{experts} (or more experts with --moe-experts)")
        if s.moe_dropless and s.moe_capacity:
            below = " (below 1 it drops tokens even under perfect balance)" if s.moe_capacity < 1 else ""
            raise ConfigError(f"--moe-capacity {s.moe_capacity:g} limits what each expert takes{below}, but "
                              f"routing is dropless; pass --no-moe-dropless to drop tokens, or drop --moe-capacity")
        if not s.moe_dropless and not s.moe_capacity:
            raise ConfigError("--no-moe-dropless drops the tokens beyond each expert's capacity; give the capacity "
                              "factor with --moe-capacity (e.g. 1.25)")
        try:
            return dataclasses.replace(moe, n_experts=experts, top_k=top_k, capacity_factor=s.moe_capacity,
                                       n_dense_layers=s.moe_dense_layers or moe.n_dense_layers,
                                       aux_coef=s.moe_aux_coef, z_coef=s.moe_z_coef, bias_rate=s.moe_bias_rate)
        except ValueError as e:  # the model's expert groups, which --moe-experts and --moe-top-k must fit
            flags = (("experts", s.moe_experts), ("top-k", s.moe_top_k))
            given = " ".join(f"--moe-{flag} {n}" for flag, n in flags if n)
            raise ConfigError(f"{given} on {self.model.model}: {e}") from None

    @property
    def micro_batch(self) -> int:
        """Sequences in one micro-batch on one data-parallel rank."""
        return self.optim.global_batch // (self.layout.dp * self.layout.microbatches)

    def shared_settings(self) -> dict[str, Any]:
        """The settings every rank must agree on: all but each rank's own view of local resources."""
        return {name: value for name, value in self.settings().items() if name not in RANK_LOCAL_FIELDS}


def _bf16_device(device: str) -> bool:
    """Whether ``device`` computes in bf16 (a visible CUDA device that has it): the same on every rank of a job."""
    return device != "cpu" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


RANK_LOCAL_FIELDS = frozenset({"nproc", "progress", "out"})
SECTIONS = {f.name: f.default_factory for f in fields(Config)}
"""Each section's name (its TOML table, its ``--help`` group and its attribute) and its class."""
FIELDS = {f.name: f for section in SECTIONS.values() for f in fields(section)}
TABLE_OF = {f.name: table for table, section in SECTIONS.items() for f in fields(section)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _type_of(name: str) -> type:
    return {"int": int, "float": float, "str": str, "bool": bool, "tuple[int, ...]": tuple}[str(FIELDS[name].type)]


def _spell(value: Any) -> str:
    """A value as TOML writes it, so a message quotes what the user wrote."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


def _choices_text(choices: Collection) -> str:
    names = [_spell(c) if c == "" else str(c) for c in choices]
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def number_flag(kind: type, low: Bound, high: Bound) -> Callable[[str], Any]:
    """An argparse ``type`` for a numeric flag of the commands besides ``train`` (``generate``, ``schedule``,
    ``bench``, ``tokenizer``): the text as ``kind`` (int or float), finite and within ``low``..``high``, else
    argparse's one-line error naming the flag and the range, as :func:`check_value` does for ``train``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: must be a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(value) or outside(value, low, high):
            raise argparse.ArgumentTypeError(f"{text}: must be {range_text(low, high)}")
        return value

    return parse


def parse_flag(name: str, text: str) -> Any:
    """A flag's text as field ``name``'s type, or the text itself if it is not one (argparse hands every
    value over as text, so that :func:`check_value` reports it the same way as a bad TOML value)."""
    kind = _type_of(name)
    try:
        if kind is tuple:  # --stage-layers 1,3
            return tuple(int(count) for count in text.split(",")) if text else ()
        return kind(text) if kind in (int, float) else text
    except ValueError:
        return text


def _problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for field ``name`` (type, finiteness, choices, range), or None."""
    meta, kind = FIELDS[name].metadata, _type_of(name)
    if kind is bool and not isinstance(value, bool):
        return "must be true or false"
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be a whole number"
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return "must be a number"
    if kind is str and not isinstance(value, str):
        return "must be a string (in quotes)"
    if kind is tuple and not (isinstance(value, (tuple, list)) and all(type(v) is int for v in value)):
        return "must be a comma-separated list of layer counts, e.g. 1,3"
    if kind is float and not math.isfinite(value):
        return "must be a finite number"
    if kind is int and abs(value) >= INT64_LIMIT:
        return "must be less than 2**63 in magnitude"
    if meta["choices"] is not None and value not in meta["choices"]:
        return f"choose {_choices_text(meta['choices'])}"
    if kind in (int, float) and outside(value, meta["low"], meta["high"]):
        return f"must be {range_text(meta['low'], meta['high'])}"
    return None


def check_value(name: str, value: Any, source: str = "", written: str | None = None) -> Any:
    """``value`` for field ``name`` if it is acceptable, else a :class:`ConfigError` naming where it came from.

    The one check every value passes: ``source`` is ``""`` for a flag or API value, else the file's name; the
    value must already have the field's type (no guessing at ``steps = "2"``); ``written`` is as typed."""
    kind, given = _type_of(name), value
    if kind is tuple and isinstance(value, str):  # "1,3", as a TOML file may write it
        value = parse_flag(name, value)
    problem = _problem(name, value)
    if problem is None:
        return float(value) if kind is float else tuple(value) if kind is tuple else value
    if written is None:
        written = _spell(given) if source else str(given)
    where = f"{source}: {name} = {written}" if source else f"{_flag(name)} {written}"
    raise ConfigError(f"{where}: {problem}")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`Config` field, under its TOML section, its default said once; defaults are
    suppressed so only flags given count. Values stay text: :func:`check_value` converts them as it does
    TOML values, so both give the same message for the same mistake."""
    parser.add_argument("--config", metavar="TOML", help="TOML file of settings (flags override it)")
    groups = {table: parser.add_argument_group(f"[{table}] settings") for table in SECTIONS}
    for f in FIELDS.values():
        group = groups[TABLE_OF[f.name]]
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
        low, high = f.metadata["low"], f.metadata["high"]
        notes = [] if "(default:" in f.metadata["help"] or f.default in ("", ()) else [f"default: {f.default}"]
        notes += [range_text(low, high)] if low or high else []
        help_text = f.metadata["help"] + (f" ({'; '.join(notes)})" if notes else "")
        if _type_of(f.name) is bool:
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
            continue
        choices = f.metadata["choices"]
        metavar = "{" + ",".join(str(c) for c in choices if c != "") + "}" if choices else f.name.upper()
        group.add_argument(_flag(f.name), metavar=metavar, help=help_text, **kwargs)


TOML_LIMIT = 1 << 20
"""Bytes read from a ``--config`` file: a complete settings file is under 10 KB."""


def _read_toml(path: str) -> dict[str, Any]:
    """The parsed file, or one line saying why it cannot be read (missing, not a regular file, too large,
    not text, not TOML, nested deeper than the parser's recursion allows)."""
    try:
        return tomllib.loads(read_user_file(path, TOML_LIMIT).decode("utf-8"))
    except UnreadableFile as e:
        raise ConfigError(f"config file {e}; give --config a TOML file") from None
    except RecursionError:
        raise ConfigError(f"config file {path} nests arrays or tables too deeply to parse; settings are "
                          f"keys in [section] tables") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (invalid byte 0x{e.object[e.start]:02x} at "
                          f"offset {e.start}); give --config a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _field_name(path: str, key: str, table: str | None) -> str:
    """The field a TOML key names (``global-batch`` and ``global_batch`` alike), checked against its table."""
    name = key.replace("-", "_")
    if name not in FIELDS:
        where = f"[{table}] " if table else ""
        raise ConfigError(f"{path}: unknown key {where}{key}; valid keys are the flag names (trainmesh train --help)")
    if TABLE_OF[name] != table:
        where = f"is not a [{table}] setting" if table else "is outside any table"
        raise ConfigError(f"{path}: {key} {where}; move it to [{TABLE_OF[name]}]")
    return name


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML file of :data:`SECTIONS` tables into checked settings, by their flat names (field or flag
    spelling); an unknown or misplaced key or table, a repeated key or a bad value is one line naming it."""
    raw = _read_toml(path)
    entries: list[tuple[str, Any, str | None]] = []
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise ConfigError(f"{path}: unknown section [{key}]; sections are "
                                  f"{', '.join(f'[{s}]' for s in SECTIONS)}")
            entries += [(k, v, key) for k, v in value.items()]
        else:
            entries.append((key, value, None))
    flat: dict[str, Any] = {}
    for key, value, table in entries:
        name = _field_name(path, key, table)
        if name in flat:
            raise ConfigError(f"{path}: {name} is set twice; keep one of them")
        flat[name] = check_value(name, value, path)
    return flat


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line and its ``--config`` TOML file give (flags win), checked; what is not
    given is left out, so a caller can tell a default from a choice."""
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    for name in FIELDS:
        if hasattr(args, name):
            text = getattr(args, name)
            values[name] = (check_value(name, text) if isinstance(text, bool) else
                            check_value(name, parse_flag(name, text), written=text))
    if values.get("init_hf"):
        values["model"] = _model_of_hf_dir(values["init_hf"], values.get("model"))
    return values


def config_from_args(args: argparse.Namespace) -> Config:
    return Config.from_settings(**settings_from_args(args))


def _model_of_hf_dir(path: str, model: str | None) -> str:
    """The ``model`` an ``--init-hf`` run records: the ``--model`` given if its shape is the directory's,
    else (none given) the first preset of the directory's family, which names the family in checkpoints
    while ``Config.model_config`` gives the shape. A ``--model`` of another shape is refused."""
    try:
        spec, hf_config = hf.read_config(path)
    except hf.HFError as e:
        raise ConfigError(f"--init-hf: {e}") from None
    if model is not None and preset(model) != hf_config:
        raise ConfigError(f"--model {model} conflicts with --init-hf {path}, whose config.json gives the model's "
                          f"shape ({spec.family}: {hf_config}); drop --model")
    return model if model is not None else next(iter(spec.presets))


def vocabulary_note(cfg: Config) -> str:
    """For a model that keeps its own vocabulary (``--init-hf``): one line saying it is larger than the data's
    tokenizer's (the rows past it are never an input or a target), "" if they are equal; a smaller one is
    refused, since the data's ids past it would have no embedding."""
    if not cfg.checkpoint.init_hf:
        return ""
    tokens = data_vocab_size(cfg.data.data, cfg.data.tokenizer) or BYTE_VOCAB
    model = cfg.model_config.vocab_size
    if tokens > model:
        raise ConfigError(f"--init-hf {cfg.checkpoint.init_hf} has a vocabulary of {model} tokens but the data's tokenizer "
                          f"({cfg.data.tokenizer or 'bytes'}) has {tokens}; train with the model's own tokenizer "
                          f"(--tokenizer {cfg.checkpoint.init_hf}/tokenizer.json)")
    return (f"the model's vocabulary of {model} exceeds the tokenizer's {tokens}; ids {tokens}..{model - 1} are "
            f"never an input or a target" if model > tokens else "")


def validate(cfg: Config, world_size: int | None = None, cuda_devices: int = 0,
             cuda_capability: tuple[int, int] | None = None) -> None:
    """Raise :class:`ConfigError` for any setting that cannot run, with the fix in the message.

    The layout's rules are :func:`trainmesh.layout.validate`'s, spelled as flags; the model's shape they read
    needs the checkpoint and MoE settings checked first (``--init-hf`` gives it, ``--moe-*`` change it).
    ``cuda_capability`` is the least compute capability of the visible GPUs (what ``--precision fp8`` needs)."""
    for name, value in cfg.settings().items():
        check_value(name, value)
    _validate_checkpoints(cfg)
    _validate_moe(cfg)
    _validate_family(cfg)
    vocabulary_note(cfg)
    try:
        validate_layout(cfg.layout, spec_of(cfg.model.model).shape(cfg.model_config),
                        cfg.launch.nproc if world_size is None else world_size, spell=flag_spelling, name=_model_name(cfg))
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if world_size is None:
        check_local_ranks(cfg.launch.nproc, cfg.launch.device == "cuda", cuda_devices)
    per_step = cfg.layout.dp * cfg.layout.microbatches
    if cfg.optim.global_batch % per_step:
        raise ConfigError(
            f"--global-batch {cfg.optim.global_batch} is not divisible by dp*microbatches = {per_step}; "
            f"use a multiple of {per_step}, e.g. {per_step * max(1, round(cfg.optim.global_batch / per_step))}")
    if cfg.launch.backend == "nccl" and not cuda_devices:
        raise ConfigError("--backend nccl needs CUDA devices and none is visible; use --backend gloo")
    if cfg.launch.device == "cuda" and not cuda_devices:
        raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu")
    if cfg.layout.precision == "fp8":
        _validate_float8(cfg, cuda_capability if cfg.launch.device != "cpu" and cuda_devices else None)
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"--min-lr {cfg.optim.min_lr} exceeds --lr {cfg.optim.lr}; the cosine decay goes down to --min-lr, "
                          f"so choose --min-lr <= --lr")
    _validate_replica_group(cfg)


def _validate_replica_group(cfg: Config) -> None:
    """``--lighthouse``: each run is one replica group, so it neither splits into groups itself nor restarts on its
    own (the other groups carry on, and it heals from them when started again)."""
    launch = cfg.launch
    if launch.replica_group and not launch.lighthouse:
        raise ConfigError("--replica-group names a torchft replica group; give the job's --lighthouse http://HOST:PORT "
                          "too, or drop --replica-group")
    if not launch.lighthouse:
        return
    if cfg.layout.dp_replicate > 1:
        raise ConfigError(f"--lighthouse makes this run one replica group, so --dp-replicate {cfg.layout.dp_replicate} "
                          f"has no groups to split; drop --dp-replicate and start one run per group")
    if launch.elastic or launch.max_restarts:
        raise ConfigError("--lighthouse keeps the other replica groups training while this one is lost; restart it "
                          "by running the same command again (it heals from a live group), and drop --elastic and "
                          "--max-restarts")


def check_eval_batches(cfg: Config, val_tokens: int, source: str) -> None:
    """``--eval-batches`` against the data: evaluation draws its windows at random from the validation split,
    so batches beyond those that cover it about once only draw the same windows again (and 1e12 of them
    would evaluate silently for ever); any data allows :data:`EVAL_BATCHES_FLOOR`."""
    per_batch = cfg.optim.global_batch * cfg.model_config.seq_len
    cover = -(-val_tokens // per_batch)
    limit = max(EVAL_BATCHES_FLOOR, cover)
    if cfg.optim.eval_batches > limit:
        raise ConfigError(f"--eval-batches {cfg.optim.eval_batches}: the validation split of {source} holds "
                          f"{val_tokens:,} tokens, which {cover:,} batch(es) of {cfg.optim.global_batch} x "
                          f"{cfg.model_config.seq_len} tokens cover; choose --eval-batches at most {limit:,}")


def check_local_ranks(nproc: int, cuda: bool, cuda_devices: int) -> None:
    """Refuse more local ranks than this machine can run: one per CUDA device on GPUs, a few per core on CPUs
    (ranks beyond that only time-slice, or wait on each other's collectives)."""
    limit = cuda_devices if cuda else max(8, 4 * (os.cpu_count() or 1))
    if nproc > limit:
        where = f"{cuda_devices} CUDA device(s)" if cuda else f"{os.cpu_count()} CPU core(s)"
        raise ConfigError(f"--nproc {nproc} is more local ranks than this machine's {where} can run "
                          f"(limit {limit}); use torchrun across machines for more")


def _validate_checkpoints(cfg: Config) -> None:
    if cfg.checkpoint.init_hf and cfg.checkpoint.init_from:
        raise ConfigError("--init-hf and --init-from both give the starting weights; pass one of them")
    if cfg.checkpoint.init_hf:
        try:
            family = hf.read_config(cfg.checkpoint.init_hf)[0].family
        except hf.HFError as e:
            raise ConfigError(f"--init-hf: {e}") from None
        if spec_of(cfg.model.model).family != family:
            raise ConfigError(f"--model {cfg.model.model} is a {spec_of(cfg.model.model).family} model but --init-hf "
                              f"{cfg.checkpoint.init_hf} holds a {family} one; drop --model")
    needs_dir = [flag for flag, given in (("--resume", cfg.checkpoint.resume), ("--checkpoint-every", cfg.checkpoint.checkpoint_every),
                                          ("--max-restarts", cfg.launch.max_restarts)) if given]
    if needs_dir and not cfg.checkpoint.checkpoint_dir:
        raise ConfigError(f"{needs_dir[0]} works on checkpoints; set --checkpoint-dir DIR")
    if cfg.checkpoint.memory_snapshot != "off" and not (cfg.checkpoint.resume or cfg.launch.max_restarts):
        raise ConfigError(f"--memory-snapshot {cfg.checkpoint.memory_snapshot} keeps state for a restart to resume "
                          f"from; add --resume --checkpoint-dir DIR (or --max-restarts N)")
    if cfg.checkpoint.overwrite and cfg.checkpoint.resume:
        raise ConfigError("--overwrite deletes the checkpoints and records --resume would continue from; pass one "
                          "of them")


def _validate_moe(cfg: Config) -> None:
    """The ``[moe]`` settings: any changed from its default is refused on a dense model
    (``Config._moe_config`` checks them against the model's experts)."""
    if getattr(cfg.model_config, "moe", None) is None:
        given = [f.name for f in fields(cfg.moe) if getattr(cfg.moe, f.name) != f.default]
        if given:
            flag = "--no-moe-dropless" if given[0] == "moe_dropless" else _flag(given[0])
            raise ConfigError(f"{flag} configures mixture-of-experts layers, which "
                              f"{_model_name(cfg)} does not have; use an MoE model (moe-tiny, llama-moe-tiny) "
                              f"or drop it")


def _model_name(cfg: Config) -> str:
    """How messages name the model: its preset, or the directory ``--init-hf`` took its shape from."""
    return f"the model in {cfg.checkpoint.init_hf}" if cfg.checkpoint.init_hf else cfg.model.model


def _validate_float8(cfg: Config, capability: tuple[int, int] | None) -> None:
    """``--precision fp8``: torchao installed, FP8 tensor cores (or CPU ranks), and a family that names the
    layers it keeps in bf16."""
    problem = fp8_problem(capability)
    if problem:
        raise ConfigError(problem)
    spec = spec_of(cfg.model.model)
    if not spec.high_precision:
        raise ConfigError(f"--precision fp8: the {spec.family} family of {_model_name(cfg)} names no layers to "
                          f"keep in bf16 (embedding, head, router); use --precision bf16")


def _validate_family(cfg: Config) -> None:
    """``--cp`` needs the model's family to name the attention cores and position inputs it splits;
    ``--document-mask`` a family whose attention reads documents, eager blocks and prepared data."""
    spec = spec_of(cfg.model.model)
    if cfg.data.document_mask and not spec.documents:
        raise ConfigError(f"--document-mask: the {spec.family} family of {cfg.model.model} does not read packed "
                          f"documents; train without --document-mask")
    if cfg.data.document_mask and cfg.layout.compile:
        raise ConfigError("--document-mask changes every micro-batch's masks and positions, which --compile's traced "
                          "blocks do not follow; drop --compile")
    if cfg.data.document_mask and cfg.data.data and not is_prepared(cfg.data.data):
        raise ConfigError(f"--document-mask: {cfg.data.data} is not prepared data, so no end-of-document token "
                          f"marks where documents end; run 'trainmesh prepare' on it and train on its output")
    if cfg.data.document_mask and not cfg.data.data:
        raise ConfigError("--document-mask: the default corpus is not prepared data, so no end-of-document token "
                          "marks where documents end; run 'trainmesh prepare' and pass its output as --data")
    if cfg.layout.cp > 1 and not spec.cp_plan:
        raise ConfigError(f"--cp {cfg.layout.cp}: the {spec.family} family of {cfg.model.model} names no attention core "
                          f"context parallelism can split; use --cp 1")
