"""``trainmesh``: the command line.

``trainmesh train --nproc N`` checks the configuration, then spawns N local ranks that re-enter this entry
point with ``RANK`` set; under torchrun or srun the command runs as a rank directly."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import trainmesh
from trainmesh.models import any_config, config_from_dict, family, hf, preset, register_preset, spec_of
from trainmesh.tracking import runlock
from trainmesh.distributed import elastic
from trainmesh.distributed import shm
from trainmesh.app.checkpoints import check_resumable, claim, model_settings
from trainmesh.checkpoint import CheckpointError, export, export_hf, memory
from trainmesh.app.config import (AT_LEAST_0, AT_LEAST_1, MAX_STEPS, Bound, Config, ConfigError, add_config_flags,
                                  check_eval_batches, check_local_ranks, check_value, config_from_args, number_flag,
                                  parse_flag, settings_from_args, validate)
from trainmesh.data import DataError, TokenData
from trainmesh.app.generate import GenerateError, Sampling, generate_text
from trainmesh.distributed.launcher import STOPPED_GRACE_S
from trainmesh.distributed.mesh import STORE_CLIENT_ENV, world_env, world_from_env
from trainmesh.layout import LayoutError, scaled_to_world
from trainmesh.layout import flag as spell_flag
from trainmesh.tracking.records import MetricsError
from trainmesh.tracking.report import ReportError
from trainmesh.app.rundir import check_run_dirs, default_out_dir, make_out_fresh
from trainmesh.data.tokenizer import TokenizerError


MAX_VOCAB = Bound(1 << 20)  # tokens in a vocabulary (the largest published are ~256k)
MAX_WORKERS = 1024  # tokenizing processes: beyond the cores they only add memory; a larger count is a typo


DESCRIPTION = ("Train one model across many processes: data, ZeRO, tensor, pipeline, context and expert parallel on "
               "one device mesh; plan a layout, report, export and decode a run. 'trainmesh COMMAND --help' lists a "
               "command's flags.")
"""What ``trainmesh --help`` says first: plain text, as a terminal shows it."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that point at ``--help``."""

    def error(self, message: str):
        self.exit(2, f"trainmesh: error: {message} (see '{self.prog} --help')\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainmesh", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"trainmesh {trainmesh.__version__}")
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
    bench.add_argument("--pairs", type=number_flag(int, AT_LEAST_1, Bound(10_000)), default=35,
                       help="timed pairs of steps, one step of each implementation (1 to 10,000)")
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
    export.add_argument("--overwrite", action="store_true", help="with --hf: replace the files of DIR the export "
                        "writes (config.json, weights, tokenizer files...), which are otherwise refused")
    report = sub.add_parser("report", help="plot a run's loss, throughput, memory and communication, or compare runs",
                            description="Draw RUN_DIR/report.png from the run's metrics.jsonl (loss and eval loss, "
                                        "tokens/s, peak memory per rank, communication per mesh axis) and print a "
                                        "summary. Works on a finished, crashed or running run. Given several runs, "
                                        "overlay them on one figure (loss against step and tokens, tokens/s, peak "
                                        "memory), each labelled by the settings in which they differ, and print "
                                        "those differences as a table.")
    report.add_argument("run_dir", metavar="RUN_DIR", nargs="+", help="a training run's --out directory, or several")
    report.add_argument("--png", metavar="FILE", help="where to draw the figure (default: RUN_DIR/report.png for "
                        "one run, compare.png here for several)")
    _add_data_parsers(sub)
    _add_generate_parser(sub)
    return parser


def _report(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.tracking.report import COMPARE_FILE, compare, report

    runs = [Path(d) for d in args.run_dir]
    if len(runs) == 1:
        print(report(runs[0], Path(args.png) if args.png else None))
    else:
        print(compare(runs, Path(args.png or COMPARE_FILE)))
    return 0


def _add_data_parsers(sub: argparse._SubParsersAction) -> None:
    """``tokenizer train`` and ``prepare``: the offline steps that turn text into token shards."""
    tokenizer = sub.add_parser("tokenizer", help="train a tokenizer",
                               description="Tokenizer tools (Hugging Face tokenizers, offline).")
    tok_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train", help="train a byte-level BPE tokenizer on local text",
                                   description="Train a byte-level BPE (with an <|endoftext|> token) on local "
                                               "text and save it as a tokenizer.json.")
    tok_train.add_argument("--input", nargs="+", default=[], metavar="PATH",
                           help="text, JSONL, Parquet files, saved HF datasets or directories of them "
                                "(default: this Python's standard library sources)")
    tok_train.add_argument("--vocab-size", type=number_flag(int, AT_LEAST_1, MAX_VOCAB), default=8192,
                           help=f"vocabulary size, at most {MAX_VOCAB.value:,} (default: 8192)")
    tok_train.add_argument("--out", required=True, metavar="FILE", help="the tokenizer.json to write")
    prepare = sub.add_parser("prepare", help="tokenize a corpus into memory-mapped token shards",
                             description="Tokenize text in parallel worker processes into fixed-dtype token "
                                         "shards and an index.json, for train --data DIR.")
    prepare.add_argument("--input", nargs="+", required=True, metavar="PATH",
                         help="text files, JSONL (a 'text' field per line), Parquet (a 'text' column), a "
                              "directory saved by HF datasets save_to_disk, or directories of these")
    prepare.add_argument("--tokenizer", required=True, metavar="FILE",
                         help="the tokenizer.json to tokenize with (trainmesh tokenizer train makes one); with "
                              "--chat, a tokenizer folder holding tokenizer.json and a chat template")
    prepare.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory for the shards")
    prepare.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1),
                         help=f"tokenizing processes, 1 to {MAX_WORKERS} (default: one per CPU core)")
    prepare.add_argument("--shard-tokens", type=int, default=1 << 27,
                         help="tokens per shard file, cut at a document end (default: 2**27)")
    prepare.add_argument("--val-fraction", type=float, default=0.05,
                         help="fraction of documents held out for validation, whole (default: 0.05)")
    prepare.add_argument("--chat", action="store_true",
                         help='JSONL conversations ({"messages": [{"role": ..., "content": ...}, ...]} per line), '
                              "rendered with the tokenizer folder's chat template, with a loss mask (docs/data.md)")
    prepare.add_argument("--train-on", choices=("assistant", "all"),
                         help="with --chat: the tokens trained, the assistant's turns or all (default: assistant)")


def _tokenizer(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.data.sources import document_texts
    from trainmesh.data.tokenizer import train_bpe

    tok = train_bpe(document_texts(args.input), args.vocab_size, Path(args.out))
    print(f"trained a byte-level BPE of {tok.vocab_size:,} tokens; wrote {args.out}")
    return 0


def _prepare(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.data.prepare import PrepareOptions, prepare

    for flag, value, ok, want in (("--workers", args.workers, 1 <= args.workers <= MAX_WORKERS,
                                   f"1 to {MAX_WORKERS} (each is a process holding the tokenizer and two batches)"),
                                  ("--shard-tokens", args.shard_tokens, args.shard_tokens >= 1, "at least 1"),
                                  ("--val-fraction", args.val_fraction, 0 < args.val_fraction < 1, "in (0, 1)")):
        if not ok:
            raise ConfigError(f"{flag} {value}: must be {want}")
    if args.train_on and not args.chat:
        raise ConfigError(f"--train-on {args.train_on} chooses the trained tokens of chat data; add --chat, or drop it")
    prepare(PrepareOptions(tuple(args.input), args.tokenizer, args.out, args.workers, args.shard_tokens,
                           args.val_fraction, args.chat, args.train_on or "assistant"))
    return 0


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="continue a prompt with the model of a checkpoint",
                         description="Load a checkpoint saved in any layout into one process and continue a "
                                     "prompt with its model (KV-cached decoding), in the run's tokenizer. The "
                                     "text goes to stdout; what was loaded and the speed to stderr.")
    gen.add_argument("--checkpoint-dir", required=True, metavar="DIR",
                     help="a training run's --checkpoint-dir (its latest checkpoint), or one step-N directory")
    gen.add_argument("--step", type=number_flag(int, AT_LEAST_0, MAX_STEPS),
                     help="use the checkpoint of this step (default: the latest)")
    gen.add_argument("--prompt", required=True, help="the text to continue; a prompt longer than the model's "
                     "seq_len keeps its last seq_len tokens")
    gen.add_argument("--max-new-tokens", type=number_flag(int, AT_LEAST_1, Bound(1 << 20)), default=64,
                     help="tokens to generate, at most 2**20 (default: 64)")
    gen.add_argument("--temperature", type=number_flag(float, AT_LEAST_0, Bound(1000)), default=0.8,
                     help="divide the logits by this before sampling; 0: greedy (default: 0.8)")
    gen.add_argument("--top-k", type=number_flag(int, AT_LEAST_0, MAX_VOCAB), default=0,
                     help="sample among the k most likely tokens only (default: 0, all)")
    gen.add_argument("--top-p", type=number_flag(float, Bound(0, strict=True), Bound(1)), default=1.0,
                     help="sample among the fewest most likely tokens whose probability reaches p only (nucleus "
                     "sampling; default: 1, all)")
    gen.add_argument("--seed", type=number_flag(int, AT_LEAST_0, Bound(2**63 - 1)), default=0,
                     help="seed of the sampling; the same seed gives the same text (default: 0)")
    gen.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json to use; refused unless it is the file "
                     "the run trained with (default: the one the checkpoint records)")
    gen.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="auto picks cuda when present (default: auto)")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user's message through the chat template the checkpoint keeps (its "
                     "--init-hf folder's, else its chat data's) and print the reply only")


def _generate(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    _check_text("--prompt", args.prompt)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    reply = generate_text(args.checkpoint_dir, args.prompt, args.max_new_tokens, sampling, args.step, args.tokenizer,
                          args.device, args.chat)
    print(reply if args.chat else args.prompt + reply)
    return 0


def _check_text(flag: str, text: str) -> None:
    """Refuse an argument holding bytes that are not UTF-8 (Python hands them over as lone surrogates, which
    no tokenizer can encode), naming the first."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else None
        what = f"byte 0x{byte:02x}" if byte is not None else f"code point U+{ord(text[e.start]):04X}"
        raise ConfigError(f"{flag} holds {what} at character {e.start}, which is not UTF-8 text; give the "
                          f"text in UTF-8") from None


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


def _export_hf_target(out: Path, overwrite: bool) -> None:
    """Refuse an ``export --hf`` directory that cannot be written (it and its parents are created) or already
    holds a model (unless ``overwrite``)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export --hf {out} is a file; name the directory to write the model to")
    if not overwrite and any(os.path.lexists(out / name) for name in (hf.CONFIG, hf.WEIGHTS, hf.INDEX)):
        raise ConfigError(f"export --hf {out} already holds a model; choose an empty or new directory, or pass "
                          f"--overwrite to replace it")
    existing = next(p for p in (out, *out.parents) if p.exists())  # the directory and its parents are created
    if not existing.is_dir():
        raise ConfigError(f"export --hf {out}: {existing} is a file; choose another place")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"export --hf {out}: {existing} is not writable; choose another place")


def _export(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    to = Path(args.hf or args.to)
    if args.hf:
        _export_hf_target(to, args.overwrite)
    else:
        _export_target(to)
    try:
        print(export_hf(Path(args.checkpoint), to, args.overwrite) if args.hf else export(Path(args.checkpoint), to))
    except OSError as e:
        raise ConfigError(f"exporting {args.checkpoint} to {to} failed: {e}") from None
    return 0


def _add_launch_parser(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser("launch", help="run a Python training script as N local ranks",
                            description="Run SCRIPT ARGS as N local ranks, each with the environment torchrun "
                                        "gives (RANK, WORLD_SIZE, ...; trainmesh.init_mesh reads it), a rendezvous "
                                        "on 127.0.0.1 only, and every rank stopped as soon as one fails, the "
                                        "failing rank named with its traceback. Rank 0's output is shown (--tee: others), every "
                                        "rank's kept with --log-dir. With "
                                        "--nnodes MIN:MAX, run `train ARGS` under torch's elastic agent instead, "
                                        "restarting on the nodes that remain when one is lost.")
    launch.add_argument("--nproc", "--nproc-per-node", dest="nproc", default="1", metavar="N",
                        help="ranks to start on this node (default: 1)")
    launch.add_argument("--stopped-grace", default=str(STOPPED_GRACE_S), metavar="SECONDS",
                        help=f"end the job when a rank stays stopped (SIGSTOP, a debugger) this long; a warning "
                        f"names it at once (default: {STOPPED_GRACE_S:g})")
    launch.add_argument("--log-dir", metavar="DIR", help="keep each rank's stdout and stderr in DIR/rank-N.log "
                        "(a header names its host); a failing run's report names these files")
    launch.add_argument("--tee", default="0", metavar="RANKS", help="ranks whose output is streamed here, "
                        "comma-separated (0,1) or all; each line then starts [rank N] (rank 0 alone streams "
                        "unprefixed; default: 0)")
    launch.add_argument("--nnodes", default=os.environ.get("NNODES", "1"), metavar="N|MIN:MAX",
                        help="nodes, one launcher on each (default: $NNODES or 1); a range MIN:MAX runs `train` "
                             "under torch's elastic agent, going on with at least MIN nodes when one is lost")
    launch.add_argument("--node-rank", metavar="K",
                        help="this node's number, 0 to nnodes-1; node 0 hosts the rendezvous (default: $NODE_RANK "
                             "or 0; not with MIN:MAX, whose agents number the nodes)")
    launch.add_argument("--master-addr", metavar="ADDR",
                        help="node 0's address, where it listens for the other nodes (default: $MASTER_ADDR or "
                             "127.0.0.1; MIN:MAX meets at --rdzv-endpoint instead)")
    launch.add_argument("--master-port", metavar="PORT",
                        help="the port node 0 listens on (needed with --nnodes > 1; default: $MASTER_PORT)")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                        help="with MIN:MAX: the c10d rendezvous, one node's address (its agent hosts it) and a "
                             "port, the same on every node")
    launch.add_argument("--rdzv-id", default="trainmesh", metavar="ID",
                        help="with MIN:MAX: the job's name, so jobs sharing an endpoint never meet (default: "
                             "trainmesh)")
    launch.add_argument("--rdzv-conf", default="", metavar="K=V,...",
                        help="with MIN:MAX: rendezvous settings, as torchrun's (join_timeout=600, "
                             "last_call_timeout=30, ...)")
    launch.add_argument("--max-restarts", metavar="K",
                        help=f"with MIN:MAX: how often each node's agent restarts its ranks after a failure or a "
                             f"lost node (default: {elastic.DEFAULT_MAX_RESTARTS})")
    launch.add_argument("script", help="the Python file to run on every rank (with MIN:MAX: train)")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to the script")


STATIC_ONLY = ("node_rank", "master_addr", "master_port")
ELASTIC_ONLY = ("rdzv_endpoint", "rdzv_conf", "max_restarts")


def _given(args: argparse.Namespace, names: Sequence[str]) -> str:
    """The flags among ``names`` given on the command line (their defaults are None or empty), as the subject
    of a sentence ("--a and --b are"); empty if none."""
    flags = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name)]
    return f"{' and '.join(flags)} {'is' if len(flags) == 1 else 'are'}" if flags else ""


def _launch(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    nproc = check_value("nproc", parse_flag("nproc", args.nproc), written=args.nproc)
    grace = check_value("stopped_grace", parse_flag("stopped_grace", args.stopped_grace), written=args.stopped_grace)
    check_local_ranks(nproc, _cuda_devices() > 0, _cuda_devices())
    try:
        span = elastic.node_range(args.nnodes)
    except ValueError as e:
        raise ConfigError(f"launch: {e}") from None
    if span is not None:
        return _launch_elastic(args, nproc, span)
    if _given(args, ELASTIC_ONLY):
        raise ConfigError(f"launch: {_given(args, ELASTIC_ONLY)} for the elastic agent; give "
                          f"--nnodes MIN:MAX (e.g. {args.nnodes}:{args.nnodes}) with them, or drop them")
    from trainmesh.distributed.launcher import Nodes, launch

    numbers = {}
    for name, env, default in (("nnodes", "NNODES", "1"), ("node_rank", "NODE_RANK", "0"),
                               ("master_port", "MASTER_PORT", "0")):
        text = getattr(args, name) or os.environ.get(env, default)
        if not text.isdigit():
            raise ConfigError(f"launch: --{name.replace('_', '-')} {text!r} is not a whole number")
        numbers[name] = int(text)
    nodes = Nodes(master_addr=args.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"), **numbers)
    try:
        nodes.check()
    except ValueError as e:
        raise ConfigError(f"launch: {e}") from None
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"launch: script {script} does not exist or is not a file")
    return launch(args.args, nproc, program=(str(script),), stopped_grace=grace, nodes=nodes,
                  log_dir=Path(args.log_dir) if args.log_dir else None, tee=_tee(args.tee, nodes.nnodes * nproc))


def _launch_elastic(args: argparse.Namespace, nproc: int, span: tuple[int, int]) -> int:
    """``launch --nnodes MIN:MAX``: every flag checked, then ``train --elastic`` under torch's elastic agent."""
    static = _given(args, STATIC_ONLY)
    if static:
        raise ConfigError(f"launch --nnodes {args.nnodes}: {static} for a fixed node count; the "
                          f"elastic agents number the nodes and meet at --rdzv-endpoint, so drop them")
    if not args.rdzv_endpoint:
        raise ConfigError(f"launch --nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT: one node's address and a "
                          f"port, the same on every node")
    restarts = args.max_restarts or str(elastic.DEFAULT_MAX_RESTARTS)
    if not restarts.isdigit():
        raise ConfigError(f"launch: --max-restarts {restarts!r} is not a whole number")
    try:
        elastic.check_endpoint(args.rdzv_endpoint)
        conf = elastic.rdzv_conf(args.rdzv_conf)
        argv = elastic.train_argv(args.script, args.args)
    except ValueError as e:
        raise ConfigError(f"launch: {e}") from None
    settings = settings_from_args(_parser().parse_args(argv))  # a flag train refuses, refused before any agent
    if not (settings.get("resume") and settings.get("checkpoint_dir")):
        raise ConfigError(f"launch --nnodes {args.nnodes} restarts `train` from its last checkpoint on the nodes that "
                          f"remain: give it --checkpoint-dir DIR and --resume")
    nodes = elastic.ElasticNodes(*span, args.rdzv_endpoint, args.rdzv_id, int(restarts), conf)
    return elastic.launch_elastic(argv, nproc, nodes)


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from trainmesh.app.planning import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="predict memory and step time of every layout; pick the best",
                                      description="Predict, before launching, which layouts fit in memory and "
                                                  "which is fastest (no ranks are started)."))


def _plan(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.app.planning import plan_from_args

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
    schedule.add_argument("--pp", type=number_flag(int, AT_LEAST_1, Bound(64)), default=4,
                          help="pipeline ranks, at most 64 (default: 4)")
    schedule.add_argument("--microbatches", type=number_flag(int, AT_LEAST_1, Bound(256)), default=8,
                          help="micro-batches per step, at most 256 (default: 8)")
    schedule.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="default: 1f1b")
    schedule.add_argument("--virtual-stages", type=number_flag(int, AT_LEAST_1, Bound(16)), default=1,
                          help="model chunks per rank, interleaved only, at most 16 (default: 1); pp x "
                          f"microbatches x virtual stages at most {SCHEDULE_ACTIONS:,}")
    schedule.add_argument("--png", help="draw the timeline (ranks x time, coloured by action) to this file")
    schedule.add_argument("--costs", help="simulate with the measured costs (JSON) that trainmesh train --timeline "
                          "writes beside its picture, instead of F=1, B=2 and free communication")


SCHEDULE_ACTIONS = 2048
"""Largest pp x microbatches x virtual stages ``schedule`` simulates: the simulation and the table it prints grow
with it, and beyond this they take minutes and print more than anyone reads."""


def _schedule(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    from trainmesh.pipeline.draw import schedule_command

    if args.pp * args.microbatches * args.virtual_stages > SCHEDULE_ACTIONS:
        raise ConfigError(f"--pp {args.pp} x --microbatches {args.microbatches} x --virtual-stages "
                          f"{args.virtual_stages} is more "
                          f"than the {SCHEDULE_ACTIONS:,} stage-micro-batches schedule simulates; choose fewer")

    try:
        print(schedule_command(args.pp, args.microbatches, args.schedule, args.virtual_stages, args.png, args.costs))
    except (ValueError, ImportError) as e:
        print(f"trainmesh: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_capability() -> tuple[int, int] | None:
    """The least compute capability among the visible GPUs (None without one)."""
    import torch

    return min(map(torch.cuda.get_device_capability, range(_cuda_devices())), default=None)


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


RESOLVED_ENV = "TRAINMESH_RESOLVED_RUN"
"""Where a rank trainmesh's launcher starts finds its run: the launcher's resolved, validated configuration as
JSON (:func:`resolved_env`), so ranks are started with no training command line to parse, plan or check again."""


def resolved_env(cfg: Config, restarted: bool = False) -> dict[str, str]:
    """The environment that hands the ranks ``cfg``, with its preset's family and config: a preset the
    launcher registered for this run alone (a model a script saved, resumed by name) is one the ranks lack.
    Restarted ranks resume from the latest complete checkpoint, which the first attempt already cleared the
    directory for."""
    if restarted:
        cfg = cfg.replace(resume=True, overwrite=False)
    run = {"config": cfg.settings()}
    if not cfg.checkpoint.init_hf:
        run |= {"family": spec_of(cfg.model.model).family, "preset": dataclasses.asdict(preset(cfg.model.model))}
    return {RESOLVED_ENV: json.dumps(run)}


def _handed_config() -> Config:
    """The run :func:`resolved_env` handed this rank, its preset registered here as in the launcher."""
    run = json.loads(os.environ[RESOLVED_ENV])
    cfg = Config.from_settings(**run["config"])
    if "family" in run:
        spec = family(run["family"])
        register_preset(spec, cfg.model.model, config_from_dict(any_config(spec), run["preset"]))
    return cfg


def checked_config(args: argparse.Namespace) -> Config:
    """The configuration, validated against this process's world (or the one about to be spawned); a rank
    the launcher started takes the one it was handed (:data:`RESOLVED_ENV`)."""
    if RESOLVED_ENV in os.environ and _is_rank():
        return _handed_config()
    given = settings_from_args(args)
    cfg = Config.from_settings(**given)
    if cfg.checkpoint.resume and cfg.checkpoint.checkpoint_dir and not given.keys() & {"model", "init_hf"}:
        cfg = cfg.replace(**model_settings(Path(cfg.checkpoint.checkpoint_dir), given.keys()))
    world = _world_from_env()
    if cfg.launch.elastic and world is not None:
        cfg = _scaled(cfg, world)
    if cfg.launch.plan == "auto":
        cfg = _planned(cfg, world or cfg.launch.nproc)
    validate(cfg, world_size=world, cuda_devices=_cuda_devices(),
             cuda_capability=_cuda_capability() if cfg.layout.precision == "fp8" else None)
    _export_host_transport(cfg)
    if not _is_rank():
        _tee(cfg.logging.tee, cfg.launch.nproc)
        _check_fits(cfg)
        _check_watch_packages(cfg, explicit_tensorboard=getattr(args, "tensorboard", None) is True)
        data = TokenData.load(cfg.data.data, cfg.model_config.seq_len, cfg.data.tokenizer, verify=True)
        if data.note:
            print(f"trainmesh: {data.note}", file=sys.stderr, flush=True)
        check_eval_batches(cfg, len(data.val), data.source)
        check_resumable(cfg)
    return cfg


def _scaled(cfg: Config, world: int) -> Config:
    """``--elastic``: the config on the world the launcher gave (:func:`trainmesh.layout.scaled_to_world`)."""
    try:
        layout = scaled_to_world(cfg.layout, world, spell=spell_flag)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    return cfg.replace(dp=layout.dp, dp_replicate=layout.dp_replicate)


def _export_host_transport(cfg: Config) -> None:
    """``--host-transport off`` as ``TRAINMESH_HOST_TRANSPORT=off``, the one setting the comms read
    (:func:`trainmesh.distributed.shm.enabled`): the launcher's ranks inherit this process's environment, and under torchrun
    each rank parses the flag itself. ``auto`` leaves the environment's say; a value there that is neither is
    refused here, before any rank starts."""
    if cfg.launch.host_transport == "off":
        os.environ[shm.TRANSPORT_ENV] = "off"
    try:
        shm.enabled()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_fits(cfg: Config) -> None:
    """Refuse a model whose state alone exceeds this machine's memory per rank, before any rank starts."""
    from trainmesh.app.planning import state_fit_problem

    problem = state_fit_problem(cfg, cfg.launch.nproc, _cuda_devices())
    if problem:
        raise ConfigError(problem)


def _check_watch_packages(cfg: Config, explicit_tensorboard: bool) -> None:
    """Refuse ``--wandb`` (and an explicit ``--tensorboard``) without its package before any rank starts;
    TensorBoard is on by default, so without ``--tensorboard`` on the line a missing package only turns it off."""
    from trainmesh.tracking.records import package_available

    if cfg.logging.wandb and not package_available("wandb"):
        raise ConfigError(f"--wandb {cfg.logging.wandb} needs the wandb package: pip install wandb, or drop --wandb")
    if explicit_tensorboard and not package_available("tensorboard"):
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'trainmesh[watch]', "
                          "or pass --no-tensorboard")


def _planned(cfg: Config, world: int) -> Config:
    """``--plan auto``: the planner's fastest layout that fits this world and validates; rank 0 prints it."""
    from trainmesh.app.planning import plan_config

    try:
        cfg, line = plan_config(cfg, world, _cuda_devices())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if world_from_env()[0] == 0:
        print(line, flush=True)
    return cfg


def _with_out_dir(cfg: Config) -> Config:
    """Fix the run directory before spawning so every rank (and the user) agrees on it."""
    return cfg if cfg.logging.out else cfg.replace(out=default_out_dir())


def _owns_run_dirs() -> bool:
    """Whether this process checks and locks the run's directories and claims the checkpoint directory:
    the command the user started (which spawns the ranks, or is the only one), or rank 0 under torchrun;
    never a rank this CLI spawned."""
    return not _is_rank() or (world_env().rank == 0 and os.environ.get(STORE_CLIENT_ENV) != "1")


def _train(args: argparse.Namespace, _argv: Sequence[str]) -> int:
    cfg = checked_config(args)
    if not _owns_run_dirs():
        return _train_here(cfg)
    if not _is_rank():
        cfg = _with_out_dir(cfg)
    check_run_dirs(cfg)
    out_lock = runlock.hold(Path(cfg.logging.out), "--out") if cfg.logging.out else contextlib.nullcontext()
    with claim(cfg) as run_id, out_lock:
        make_out_fresh(cfg)
        if not _is_rank() and (cfg.launch.nproc > 1 or cfg.launch.max_restarts):
            from trainmesh.distributed.launcher import launch_with_restarts
            from trainmesh.app.train import FAULT_ENV

            try:
                return launch_with_restarts(["train"], cfg.launch.nproc, cfg.launch.max_restarts,
                                            functools.partial(resolved_env, cfg), clear_on_restart=(FAULT_ENV,),
                                            stopped_grace=cfg.launch.stopped_grace,
                                            log_dir=Path(cfg.logging.out) / LOGS_DIR,
                                            tee=_tee(cfg.logging.tee, cfg.launch.nproc))
            finally:  # the ranks' memory snapshots end with the job, also when it failed
                if run_id:
                    memory.discard(memory.snapshot_dir(), run_id)
        return _train_here(cfg)


LOGS_DIR = "logs"
"""Where in ``--out`` the launcher keeps each rank's output (``rank-N.log``)."""


def _tee(text: str, world: int) -> frozenset[int]:
    """``--tee`` as the launcher takes it, or one line saying what to give."""
    from trainmesh.distributed.launcher import parse_tee

    try:
        return parse_tee(text, world)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _train_here(cfg: Config) -> int:
    """Train as one rank in this process (the only one, or one of many under torchrun or the launcher); the
    process group is left at exit (:func:`trainmesh.distributed.mesh.leave_at_exit`). A run that diverged
    says so in its one line (every rank sees the same norms, so all stop on the same step)."""
    from trainmesh.app.train import RunStopped, TrainingDiverged, train

    try:
        train(cfg)
    except RunStopped:
        pass  # another rank failed and reports it; this one only stopped with it
    except TrainingDiverged as e:
        print(f"trainmesh: error: {e}", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.form == "all":
        from trainmesh_bench.suite import run_all

        cfg = config_from_args(args)
        return run_all(cfg.launch.nproc, cfg.model.model, cfg.optim.global_batch, args.pairs,
                       cfg.logging.out or default_out_dir())
    cfg = checked_config(args)
    if not _is_rank() and cfg.launch.nproc > 1:
        from trainmesh.distributed.launcher import launch

        return launch(argv, cfg.launch.nproc)
    from trainmesh_bench.common import Setup, write_results
    from trainmesh_bench.dp import bench_dp
    from trainmesh_bench.pp import bench_pp
    from trainmesh_bench.tp import bench_tp
    from trainmesh_bench.zero import bench_zero

    bench_form = {"dp": bench_dp, "zero": bench_zero, "pp": bench_pp, "tp": bench_tp}[args.form]
    setup = Setup(cfg.model.model, cfg.layout, cfg.optim.global_batch, cfg.model_config, cfg.model.seed, cfg.data.data, cfg.data.tokenizer,
                  cfg.optim.steps, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, (cfg.optim.beta1, cfg.optim.beta2), cfg.optim.weight_decay,
                  cfg.optim.grad_clip, cfg.launch.device, cfg.launch.backend, cfg.launch.collective_timeout)
    write_results(bench_form(setup, pairs=args.pairs), args.results)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        commands = {"train": _train, "bench": _bench, "schedule": _schedule, "plan": _plan, "export": _export,
                    "report": _report, "tokenizer": _tokenizer, "prepare": _prepare, "generate": _generate,
                    "launch": _launch}
        return commands[args.command](args, argv)
    except (ConfigError, DataError, TokenizerError, CheckpointError, runlock.DirectoryInUse, MetricsError,
            ReportError, GenerateError) as e:
        print(f"trainmesh: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
