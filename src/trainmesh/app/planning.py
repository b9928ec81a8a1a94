"""The planner (:mod:`trainmesh.plan`) wired to the command line: a run's :class:`~trainmesh.app.config.Config`
as a workload and a layout and back, the ``trainmesh train`` command a plan prints, ``--plan auto``, and the
``trainmesh plan`` command. Here because it needs :class:`Config`, which the planner itself does not import."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Iterator

from trainmesh.data import document_mix
from trainmesh.app.config import ABOVE_0, AT_LEAST_0, AT_LEAST_1, Bound, Config, number_flag
from trainmesh.layout import LayoutError, validate
from trainmesh.models import PRESET_NAMES, ModelShape, spec_of
from trainmesh.app.run_command import ModelSource, NodeSpan, command_lines, planner_only, sbatch_script
from trainmesh.layout import PRECISION_CHOICES, resolve_precision
from trainmesh.models.hf import MAX_EXPERTS, HFError, family_of, hf_dir
from trainmesh.plan import (CLUSTER_PRESETS, GIB, MODEL_PRESETS, Cluster, Estimate, Layout, Workload, choose,
                            format_table, local_cluster, make_cluster, model_shape, model_state_bytes, scaled, search,
                            to_json)
from trainmesh.plan.hf_shape import read_hf_shape
from trainmesh.plan.timing import document_saving
from trainmesh.plan.published import format_published
from trainmesh.plan.ranking import MAX_GPUS, MAX_LAYERS
from trainmesh.training.state_bytes import DTYPE_BYTES


PLANNED = ("dp", "tp", "pp", "zero", "microbatches", "schedule", "virtual_stages", "recompute", "sequence_parallel",
           "cp", "cp_impl", "ep", "dp_replicate", "stage_layers", "bucket_mb")
"""The :class:`~trainmesh.layout.Layout` settings a plan chooses; the others (precision, compile, timeline) stay
the run's own."""


def workload_of(cfg: Config) -> Workload:
    """The workload a :class:`~trainmesh.app.config.Config` trains: its model, global batch and dtypes, and under
    ``--document-mask`` the mix of document lengths its data holds."""
    model = cfg.model_config
    documents = document_mix(cfg.data.data) if cfg.data.document_mask else ()
    return Workload(spec_of(cfg.model.model).shape(model), cfg.optim.global_batch, model.seq_len, cfg.layout.precision,
                    cfg.layout.reduce_dtype, documents=documents)


def layout_of(cfg: Config) -> Layout:
    """The layout a config runs, as the planner prices it. Without a pipeline the schedule means nothing and
    is taken as 1F1B."""
    layout = Layout(**{field: getattr(cfg.layout, field) for field in PLANNED})
    return layout if layout.pp > 1 else dataclasses.replace(layout, schedule="1f1b", virtual_stages=1)


def with_layout(cfg: Config, layout: Layout) -> Config:
    """``cfg`` running ``layout``'s planned settings instead of its own (on ``layout.world`` local ranks)."""
    return cfg.replace(nproc=layout.world, **{field: getattr(layout, field) for field in PLANNED})


def train_flags(workload: Workload, layout: Layout) -> list[str]:
    """``trainmesh train`` flags that run ``layout`` on ``workload``'s batch and dtypes: every layout field that
    applies or differs from its default, the global batch, the precision (always: ``auto`` would resolve again
    on the machine that runs it), ``--stage-layers`` when given and a non-default reduce dtype."""
    layout = dataclasses.replace(layout, reduce_dtype=workload.reduce_dtype)
    skip = {"schedule", "virtual_stages"} if layout.pp == 1 else set()
    skip |= {"cp_impl"} if layout.cp == 1 else set()
    skip |= {"ep"} if not workload.model.n_experts else set()
    skip |= {"sequence_parallel"} if not layout.sequence_parallel else set()
    skip |= {"dp_replicate"} if layout.dp_replicate == 1 else set()
    skip |= {"stage_layers", "bucket_mb"}  # the stage split only with a pipeline, the bucket only if not default
    flags = [f for field in PLANNED if field not in skip for f in _flag_of(layout, field)]
    extra = [f for field in ("bucket_mb", "reduce_dtype")
             if getattr(layout, field) != getattr(Layout(), field) for f in _flag_of(layout, field)]
    stages = ["--stage-layers", ",".join(map(str, layout.stage_layers))] if layout.stage_layers and layout.pp > 1 else []
    return [*flags, *stages, "--global-batch", str(workload.global_batch), "--precision", workload.precision, *extra]


def _flag_of(layout: Layout, field: str) -> list[str]:
    value, name = getattr(layout, field), "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return [name if value else "--no-" + name[2:]]
    return [name, f"{value:g}" if isinstance(value, float) else str(value)]


def preset_source(workload: Workload, model: str) -> ModelSource:
    """``--model`` (and ``--seq-len`` when it is not the preset's) for a preset ``train`` builds; for a
    planning-only preset (a family trainmesh does not build), the note saying so."""
    if model not in PRESET_NAMES:
        return planner_only(model)
    seq = ["--seq-len", str(workload.seq_len)] if workload.seq_len != model_shape(model).seq_len else []
    return ModelSource(("--model", model, *seq))


def nodes_of(layout: Layout, cluster: Cluster) -> NodeSpan:
    """The nodes ``layout`` fills on ``cluster``: one when it fits in a node, else whole nodes."""
    if layout.world <= cluster.gpus_per_node:
        return NodeSpan(1, layout.world)
    return NodeSpan(layout.world // cluster.gpus_per_node, cluster.gpus_per_node)


def train_command(workload: Workload, layout: Layout, cluster: Cluster, source: ModelSource) -> list[str]:
    """The lines that start ``layout``'s run (:func:`trainmesh.app.run_command.command_lines`)."""
    return command_lines(source, train_flags(workload, layout), nodes_of(layout, cluster))


def runnable_layouts(cfg: Config, world: int, cluster: Cluster) -> Iterator[Estimate]:
    """What :func:`search` finds for ``cfg``'s workload on ``cluster``, fastest first, keeping only the
    layouts the layout's rules (:func:`trainmesh.layout.validate`) accept with ``cfg``'s other settings on
    ``world`` ranks: pipeline flags without a pipeline, a schedule that cannot run with ``--compile``."""
    work = workload_of(cfg)
    for found in search(work, cluster):
        try:
            validate(with_layout(cfg, found.layout).layout, work.model, world)
        except LayoutError:
            continue
        yield found


def auto_config(cfg: Config, world: int, cluster: Cluster) -> tuple[Config, Estimate]:
    """``cfg`` with the layout :func:`~trainmesh.plan.choose` takes of those that fit ``cluster`` (``world``
    ranks) and that the runtime accepts, and that layout's estimate. ``cfg.launch.plan`` is kept: it records how
    the layout was chosen."""
    best = choose(list(runnable_layouts(cfg, world, cluster)))
    if best is None:
        work = workload_of(cfg)
        raise ValueError(
            f"--plan auto: no layout of {cfg.model.model} ({work.model.n_params():,} parameters) at global batch "
            f"{cfg.optim.global_batch} fits in {cluster.usable_bytes / GIB:.1f} usable GiB on each of {world} "
            f"rank(s) and runs with these settings; add ranks, lower --global-batch, or set the layout by hand"
        )
    return with_layout(cfg, best.layout), best


def this_machine(world: int, use_cuda: bool) -> Cluster:
    """:func:`local_cluster` of this machine: its first GPU's name and memory when ``use_cuda``."""
    if not use_cuda:
        return local_cluster(world)
    import torch

    return local_cluster(world, torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)


def state_fit_problem(cfg: Config, world: int, cuda_devices: int = 0) -> str | None:
    """Why ``cfg``'s layout cannot hold even its model state (weights, gradients, optimizer) in this
    machine's memory per rank, or None. Checked before ranks are spawned, so a full-sized preset on a
    small machine is refused in one line instead of each rank being killed for memory."""
    cluster = this_machine(world, cuda_devices > 0 and cfg.launch.device != "cpu")
    state = model_state_bytes(workload_of(cfg), layout_of(cfg))
    if state <= cluster.mem_bytes:
        return None
    source = f"--init-hf {cfg.checkpoint.init_hf}" if cfg.checkpoint.init_hf else f"--model {cfg.model.model}"  # as the user named it
    return (f"{source} at this layout needs {state / GIB:.1f} GiB of model state on each rank, more "
            f"than the {cluster.mem_bytes / GIB:.1f} GiB each of the {world} rank(s) has here; shard it over "
            f"more ranks (--zero 3, --tp, --pp), pick a smaller model, or see trainmesh plan {source}")


def plan_config(cfg: Config, world: int, cuda_devices: int = 0) -> tuple[Config, str]:
    """``trainmesh train --plan auto`` on this machine: the planned config and the line to print."""
    cluster = this_machine(world, cuda_devices > 0 and cfg.launch.device != "cpu")
    planned, chosen = auto_config(cfg, world, cluster)
    return planned, describe_choice(chosen, cluster, planned.layout.precision) + saving_note(
        workload_of(cfg), chosen.layout, cluster)


def saving_note(workload: Workload, layout: Layout, cluster: Cluster) -> str:
    """What confining attention to ``workload.documents`` saves of ``layout``'s step time ("" without documents)."""
    if not workload.documents:
        return ""
    mean = sum(workload.documents) / len(workload.documents)
    return (f"; the document mask saves {document_saving(workload, layout, cluster):.0%} of its step time "
            f"({len(workload.documents):,} documents of {mean:,.0f} tokens on average)")


def documents_flag(text: str) -> tuple[int, ...]:
    """``--documents``: document lengths as N,N,... or prepared data whose mix is measured."""
    if text.replace(",", "").isdigit() and all(text.split(",")):
        lengths = tuple(int(n) for n in text.split(","))
        if min(lengths) < 1:
            raise ValueError(f"--documents {text}: every document has at least 1 token")
        return lengths
    return document_mix(text)


def describe_choice(chosen: Estimate, cluster: Cluster, precision: str) -> str:
    """The one line ``--plan auto`` prints: the layout it runs, in which precision, and why."""
    lay = chosen.layout
    sched = f" schedule={lay.schedule}" + (f" virtual={lay.virtual_stages}" if lay.virtual_stages > 1 else "") if lay.pp > 1 else ""
    mem = scaled(chosen.memory.total, (" B", " KiB", " MiB", " GiB"), 1024)
    cp = f" cp={lay.cp} cp_impl={lay.cp_impl}" if lay.cp > 1 else ""
    ep = f" ep={lay.ep}" if lay.ep > 1 else ""
    ep += f" dp_replicate={lay.dp_replicate}" if lay.dp_replicate > 1 else ""
    return (f"trainmesh: --plan auto: dp={lay.dp} tp={lay.tp} pp={lay.pp} zero={lay.zero} "
            f"microbatches={lay.microbatches}{sched} recompute={lay.recompute} "
            f"sequence_parallel={lay.sequence_parallel}{cp}{ep} precision={precision} (predicted {chosen.time.total * 1e3:.3g} ms/step, "
            f"{mem}/rank of {cluster.usable_bytes / GIB:.1f} GiB usable)")


SHAPE_FLAGS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads", "ffn": "d_ff",
               "vocab": "vocab_size", "seq": "seq_len"}
# Integer fields of ModelShape beyond the basic shape: grouped-query attention, the head width, experts, latent
# attention.
VARIANT_FLAGS = {"kv-heads": "n_kv_heads", "head-dim": "head_dim", "experts": "n_experts", "top-k": "top_k", "expert-ffn": "d_ff_expert",
                 "shared-experts": "n_shared_experts", "dense-layers": "n_dense_layers",
                 "kv-lora-rank": "kv_lora_rank", "q-lora-rank": "q_lora_rank", "qk-rope-dim": "qk_rope_head_dim",
                 "qk-nope-dim": "qk_nope_head_dim", "v-head-dim": "v_head_dim"}
# --mlp: a GPT-2 block (GELU MLP, LayerNorm and biases, learned positions) or a Llama one (SwiGLU, RMSNorm, RoPE).
MLP_KINDS = {"gelu": {"gated_mlp": False, "bias": True, "learned_positions": True},
             "swiglu": {"gated_mlp": True, "bias": False, "learned_positions": False}}
HF_SEQ = 4096  # the sequence an HF config is planned at without --seq (its max_position_embeddings if shorter)
SIZE_LIMIT = Bound(1 << 20)  # widths, heads, vocabulary, sequence, batch: as train's bounds, far beyond any model
MAY_BE_0 = ("n_shared_experts", "n_dense_layers", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
            "qk_nope_head_dim", "v_head_dim")
"""The shape fields where 0 means none (no shared experts, no latent attention, a full query projection)."""
RATE_LIMIT = Bound(1e6)  # TFLOP/s and GB/s per device: hundreds of times today's fastest


def _shape_flag(field: str) -> Callable[[str], int]:
    """The argparse type of the flag for ModelShape ``field``: a whole number from 1 (0 where it means none)
    up to the field's bound."""
    high = {"n_layers": Bound(MAX_LAYERS), "n_dense_layers": Bound(MAX_LAYERS), "n_experts": Bound(MAX_EXPERTS),
            "top_k": Bound(MAX_EXPERTS), "n_shared_experts": Bound(MAX_EXPERTS)}.get(field, SIZE_LIMIT)
    return number_flag(int, AT_LEAST_0 if field in MAY_BE_0 else AT_LEAST_1, high)


def _script_path(text: str) -> str:
    """``--slurm``'s FILE, checked before the search: a regular file (new or not) in a writable directory,
    never a directory or a device (/dev/full), which would fail only after the search."""
    path = Path(text)
    try:
        if path.exists() and not path.is_file():
            raise argparse.ArgumentTypeError(f"{text} is not a regular file; name the script file to write")
        if not path.parent.is_dir() or not os.access(path.parent, os.W_OK) or path.exists() and \
                not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text} cannot be written; name a file in a writable directory")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e.strerror}; name the script file to write") from None
    return text


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``trainmesh plan``: a model preset or explicit shape (``--ffn`` defaults to 4 * hidden), the
    batch, and a cluster preset whose figures explicit flags override (``cli.py`` prints
    :func:`plan_from_args`; ``trainmesh train --plan auto`` calls :func:`plan_config`)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"model preset: {', '.join(MODEL_PRESETS)}")
    source.add_argument("--hf-config", metavar="DIR", help="the shape of a Hugging Face config.json (llama, mistral, "
                        "qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, gpt2)")
    source.add_argument("--init-hf", metavar="DIR", help="as --hf-config, and the command starts from DIR's weights")
    source.add_argument("--published", action="store_true",
                        help="the published runs the planner is held to: each one's error, and the planner's own "
                             "layout beside the published one (a search per run: about a minute)")
    for flag in SHAPE_FLAGS:
        parser.add_argument(f"--{flag}", type=_shape_flag(SHAPE_FLAGS[flag]),
                            help="explicit shape or override of the model's")
    for flag in VARIANT_FLAGS:
        parser.add_argument(f"--{flag}", type=_shape_flag(VARIANT_FLAGS[flag]), dest=VARIANT_FLAGS[flag],
                            help="explicit shape or override of the model's (ModelShape." + VARIANT_FLAGS[flag] + ")")
    parser.add_argument("--mlp", choices=list(MLP_KINDS), help="gelu: GPT-2 blocks (the default of an explicit "
                        "shape); swiglu: Llama blocks (gated MLP, RMSNorm, RoPE, no biases)")
    parser.add_argument("--tied", action="store_true", default=None, help="the head shares the embedding's weight")
    parser.add_argument("--global-batch", type=number_flag(int, AT_LEAST_1, SIZE_LIMIT),
                        help="sequences per optimizer step (default: one per device)")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default="auto",
                        help="as trainmesh train's (default: auto: bf16 with fp32 master weights on GPUs, fp32 on cpu)")
    parser.add_argument("--reduce-dtype", choices=["auto", *DTYPE_BYTES], default=Layout.reduce_dtype,
                        help="dtype gradients are held and reduced in, as trainmesh train's (default: "
                             f"{Layout.reduce_dtype}: fp32, or fp64 under --precision fp64)")
    devices = number_flag(int, AT_LEAST_1, Bound(MAX_GPUS))
    parser.add_argument("--gpus", type=devices, help=f"devices to plan for (1 to {MAX_GPUS:,}; all but --published)")
    parser.add_argument("--gpus-per-node", type=devices)
    parser.add_argument("--gpu", choices=list(CLUSTER_PRESETS), default="a100-80gb")
    parser.add_argument("--mem-gb", type=number_flag(float, ABOVE_0, SIZE_LIMIT),
                        help="memory per device in GiB (overrides --gpu)")
    rate = number_flag(float, ABOVE_0, RATE_LIMIT)
    parser.add_argument("--peak-tflops", type=rate, help="peak bf16 TFLOP/s per device (overrides --gpu)")
    parser.add_argument("--intra-gbps", type=rate, help="intra-node GB/s per device (overrides --gpu)")
    parser.add_argument("--inter-gbps", type=rate, help="inter-node GB/s per device (overrides --gpu)")
    parser.add_argument("--documents", metavar="N,N,...|DATA",
                        help="plan attention confined to packed documents (train --document-mask): their lengths, "
                             "or a prepared data directory whose mix is measured; the plan says what it saves")
    parser.add_argument("--top", type=number_flag(int, AT_LEAST_1, SIZE_LIMIT), default=20, help="rows to print")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--slurm", metavar="FILE", type=_script_path,
                        help="also write an sbatch script that starts the chosen run")


def workload_from(
    model: str | ModelShape | None, global_batch: int, precision: str = "fp32",
    reduce_dtype: str = Layout.reduce_dtype, **shape: object,
) -> Workload:
    """A workload from a preset (or a :class:`ModelShape`, e.g. an HF config's), from an explicit ``shape`` of
    :class:`ModelShape` field names (GPT-2 blocks unless they say otherwise; None ignored; d_ff 4 * d_model),
    or either with fields replaced. ``precision`` is resolved already."""
    given = {k: v for k, v in shape.items() if v is not None}
    if model is not None:
        resolved = dataclasses.replace(model if isinstance(model, ModelShape) else model_shape(model), **given)
    else:
        flags = {field: flag for flag, field in SHAPE_FLAGS.items() if field != "d_ff"}
        missing = [f"--{flag}" for field, flag in flags.items() if field not in given]
        if missing:
            raise ValueError(f"give --model or a whole shape; missing {' '.join(missing)}")
        resolved = ModelShape(**{"d_ff": 4 * given["d_model"], **given})
    return Workload(resolved, global_batch, resolved.seq_len, precision, reduce_dtype)


def _shape_args(args: argparse.Namespace) -> dict[str, object]:
    """The ModelShape fields the plan's shape flags give (None where not given)."""
    fields: dict[str, object] = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items()}
    fields |= {field: getattr(args, field) for field in VARIANT_FLAGS.values()}
    fields |= MLP_KINDS.get(args.mlp, {}) | {"tied_embeddings": args.tied}
    return fields


def _base_model(args: argparse.Namespace) -> tuple[str | ModelShape | None, dict[str, object]]:
    """The model to plan before the shape flags replace fields, and those fields: a preset name, an HF
    config's shape (at ``--seq``, else :data:`HF_SEQ` tokens), or nothing (an explicit shape)."""
    fields = _shape_args(args)
    directory = args.hf_config or args.init_hf
    if directory is None:
        return args.model, fields
    shape = read_hf_shape(directory)
    if fields["seq_len"] is None:
        fields["seq_len"] = min(shape.seq_len, HF_SEQ)
    return shape, fields


def hf_source(directory: str, workload: Workload, weights: bool) -> ModelSource:
    """``--init-hf DIR --seq-len N`` when ``trainmesh train`` can start from ``directory`` (``weights``: the
    plan was asked with ``--init-hf``, else only when DIR holds them); else a note saying why not."""
    try:
        family_of(json.loads((Path(directory) / "config.json").read_text()), directory)
        if weights or _has_weights(directory):
            hf_dir(directory)
            return ModelSource(("--init-hf", directory, "--seq-len", str(workload.seq_len)))
    except HFError as e:
        return planner_only(f"{directory} ({e})")
    return planner_only(f"{directory} (a config without weights; train --init-hf needs them)")


def _has_weights(directory: str) -> bool:
    return any((Path(directory) / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))


def plan_from_args(args: argparse.Namespace) -> str:
    """Run ``trainmesh plan``: parse with :func:`add_plan_arguments`, print what this returns (and write
    ``--slurm``'s script)."""
    if args.published:
        return format_published()
    if args.gpus is None:
        raise ValueError("give --gpus N, the devices to plan for (or --published for the published runs)")
    cluster = make_cluster(args.gpu, args.gpus, args.gpus_per_node, mem_gb=args.mem_gb,
                           peak_tflops=args.peak_tflops, intra_gbps=args.intra_gbps,
                           inter_gbps=args.inter_gbps)
    precision = resolve_precision(args.precision, cluster.has_bf16)
    model, fields = _base_model(args)
    workload = workload_from(model, args.global_batch or args.gpus, precision, args.reduce_dtype, **fields)
    if args.documents:
        workload = dataclasses.replace(workload, documents=documents_flag(args.documents))
    estimates = search(workload, cluster)
    chosen = choose(estimates)
    if args.json:
        return to_json(workload, cluster, estimates, chosen, args.top)
    command = [] if chosen is None else train_command(workload, chosen.layout, cluster, _source(args, workload, fields))
    if args.slurm and chosen is not None:
        script = sbatch_script(_source(args, workload, fields), train_flags(workload, chosen.layout),
                               nodes_of(chosen.layout, cluster))
        try:
            Path(args.slurm).write_text(script)
        except OSError as e:
            raise ValueError(f"--slurm {args.slurm}: cannot write the script ({e.strerror}); name another file") \
                from None
        command.append(f"# sbatch script written to {args.slurm}")
    note = f" ({args.precision}: {'bf16 devices' if cluster.has_bf16 else 'no bf16 on cpu'})" if args.precision == "auto" else ""
    saving = "" if chosen is None else saving_note(workload, chosen.layout, cluster)
    return format_table(workload, cluster, estimates, chosen, command, args.top, note) + saving.replace("; the", "\nThe", 1)


def _source(args: argparse.Namespace, workload: Workload, fields: dict[str, object]) -> ModelSource:
    """How the printed command names the model: a shape the flags changed exists only in the planner."""
    reshaped = any(v is not None for k, v in fields.items() if k != "seq_len")
    directory = args.hf_config or args.init_hf
    if reshaped or (args.model is None and directory is None):
        return planner_only("this custom shape")
    if directory is not None:
        return hf_source(directory, workload, weights=args.init_hf is not None)
    return preset_source(workload, args.model)
