"""The public API: parallel forms applied to any ``nn.Module`` by plain function calls, the CLI one user of it.

Shaped like torchtitan's ``parallelize_*`` and FSDP2's ``fully_shard`` (usage: docs/api.md).
:func:`parallelize` is the one place the forms are composed, in the order each expects: tensor parallelism
(on full weights), recomputation (on the modules TP left), the pipeline cut, then dp/ZeRO in :func:`optimizer`.
A model trainmesh did not write joins through its :class:`~trainmesh.models.spec.StageLayout`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainmesh.distributed.comm import Comm, log_all_reduce
from trainmesh.data.tokenizer import TokenizerFile
from trainmesh.parallel.context_parallel import (apply_context_parallel, balanced_shards, held_positions,
                                                shard_sequence)
from trainmesh.training.engine import Criterion, Engine, MicroBatches
from trainmesh.training.loss import divisors as loss_divisors, micro_loss, trained_count
from trainmesh.training.cuda_graphs import PLAIN_MODE, compile_mode
from trainmesh.training.float8 import convert_to_float8, device_capability, fp8_problem
from trainmesh.layout import MESH_SHAPE_RULES, MESH_SIZES, Layout, experts_problem, keyword, resolve_reduce_dtype, validate
from trainmesh.parallel.expert_parallel import (apply_expert_parallel, expert_modules, gather_experts, moe_tp_plan,
                                      split_sequence_stats)
from trainmesh.distributed.mesh import (GRAD_AXIS, REPLICA_AXIS, SHARD_AXIS, Mesh, init_distributed, leave_at_exit, pick_backend,
                            pick_device, world_env)
from trainmesh.models import SPECS, moe, spec_for
from trainmesh.models.documents import Packing, document_positions, packed
from trainmesh.models.hf import as_trainmesh
from trainmesh.models.gpt import cross_entropy
from trainmesh.models.spec import CONTRACT, ModelSpec, Staged, StageLayout
from trainmesh.training.optim import adamw_factory
from trainmesh.pipeline.partition import gather_stages
from trainmesh.pipeline.runtime import PipelineRuntime, build_pipeline
from trainmesh.training.precision import LossScaler, dtype_of
from trainmesh.parallel.recompute import Target, apply_recompute, recompute_modules
from trainmesh.parallel.tensor_parallel import apply_tensor_parallel
from trainmesh.parallel.tensor_parallel import unsharded_state_dict
from trainmesh import checkpoint
from trainmesh.tracking import runlock
from trainmesh.parallel import zero
from trainmesh.checkpoint import hf_extras
from trainmesh.checkpoint.async_save import AsyncSave, save_state_async
from trainmesh.checkpoint.manifest import show
from trainmesh.checkpoint.store import KeptFile, agreed_run_id

def init_mesh(dp: int | None = None, tp: int = 1, pp: int = 1, cp: int = 1, device: str = "auto",
              backend: str = "auto", timeout: float = 600.0, ep: int = 1, dp_replicate: int = 1,
              sequence_parallel: bool = False, etp: int = 1) -> Mesh:
    """Join the job this process was started in and return its ``pp x dp x cp x tp`` mesh.

    The world comes from torchrun's, ``trainmesh launch``'s or ``srun``'s environment; ``dp`` defaults to
    what ``tp``, ``pp`` and ``cp`` leave. ``ep`` folds experts over dp (and tp under ``sequence_parallel``),
    ``dp_replicate`` makes HSDP replica groups, ``etp`` splits each expert's FFN. Arguments: docs/api.md."""
    world = world_env().world_size
    if dp is None:  # what tp, pp and cp leave of the world; the layout's rules refuse sizes that leave none
        dp = max(1, world // max(1, tp * pp * cp))
    validate(Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp_replicate=dp_replicate,
                    sequence_parallel=sequence_parallel),
             world_size=world, rules=MESH_SHAPE_RULES)  # parallelize checks every rule once the rest is chosen
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_env().local_world_size))
    dev = pick_device(device)
    init_distributed(pick_backend(backend, dev), dev, timeout)
    mesh = Mesh.build(pp, dp, tp, dev, timeout, cp=cp, ep=ep, dp_replicate=dp_replicate,
                      sequence_parallel=sequence_parallel, etp=etp)
    leave_at_exit(mesh)
    return mesh


@dataclass(eq=False)
class ParallelModel:
    """What :func:`parallelize` returns: this rank's part of the model and how to run it.

    ``module``: the part, under the plain model's names; call it for logits (not under a pipeline).
    ``criterion``: the loss the layout needs; ``layout``: what was applied; ``engine``: set by :func:`optimizer`."""

    module: nn.Module
    mesh: Mesh
    comm: Comm
    criterion: Criterion
    vocab_parallel: bool
    layout: Layout
    pipeline: PipelineRuntime | None = None
    engine: Engine | None = field(default=None, repr=False)
    documents: bool = False  # whether its attention reads packed documents (ModelSpec.documents)
    description: tuple[dict, dict] = field(default=({}, {"family": "", "source": "model"}), repr=False)
    saves_to: set[Path] = field(default_factory=set, init=False, repr=False)  # directories whose lock it holds
    pending_save: AsyncSave | None = field(default=None, init=False, repr=False)  # the save in flight, if any

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pipeline is not None:
            raise RuntimeError("a pipeline-parallel model has no single forward on one rank; train it with "
                               "trainmesh.train_step")
        return self.module(x)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded parameters under the plain model's names, on every rank (a collective)."""
        return full_state_dict(self.module, self.engine, self.comm, pipelined=self.pipeline is not None)


def _keeps_contract(model: nn.Module) -> bool:
    return all(hasattr(model, part) for part in CONTRACT) and isinstance(getattr(model, "blocks"), nn.ModuleDict)


def _staged(model: nn.Module, spec: ModelSpec | None, pipeline: StageLayout | None) -> nn.Module:
    """The model in the stage contract: as it is if it keeps it, else :class:`Staged` by ``pipeline`` or by its
    family's layout; a plain model that needs no pipeline stays as it is."""
    layout = pipeline or (spec.layout(model) if spec is not None and spec.layout is not None else None)
    if layout is None or (pipeline is None and _keeps_contract(model)):
        return model
    staged = Staged(model, layout)
    if spec is not None:
        spec.prepare(staged)
    _retire(model)
    return staged


def _retire(model: nn.Module) -> None:
    """Make the object the user passed refuse to run or give its state: the :class:`Staged` model now owns its
    children (sharded, some dropped), so its forward would fail obscurely and its ``state_dict`` silently
    hold shards. :func:`parallelize` works in place, like FSDP2's ``fully_shard``."""
    message = (f"this {type(model).__name__} was taken apart by trainmesh.parallelize (its layers now belong to "
               f"the ParallelModel it returned, possibly sharded); use that instead: call it or train_step, "
               f"pm.state_dict() for the full weights (a collective), tm.save/tm.load; for a Hugging Face model, "
               f"save_pretrained(out, state_dict=pm.state_dict()) on one rank")

    def refuse(*_) -> None:
        raise RuntimeError(message)

    model.register_forward_pre_hook(refuse)
    model.register_state_dict_pre_hook(refuse)


def _refuse_foreign(model: nn.Module, spec: ModelSpec | None) -> None:
    """A Hugging Face model of no registered family, refused before any weight is touched: its forward
    returns a ``ModelOutput`` rather than logits and runs layers trainmesh does not know how to stage."""
    config = getattr(model, "config", None)
    if spec is not None or not type(model).__module__.startswith("transformers.") or config is None:
        return
    families = ", ".join(s.family for s in SPECS if s.layout is not None or s.hf is not None)
    raise ValueError(f"{type(model).__name__} ({getattr(config, 'model_type', '?')}) is of no registered trainmesh "
                     f"family: its forward returns {type(model).__name__}'s ModelOutput, not logits; register one "
                     f"with tm.register_family(tm.ModelSpec(...)), or train a family trainmesh has ({families}; "
                     f"trainmesh train --init-hf DIR converts their checkpoints)")


def _validate(model: nn.Module, mesh: Mesh, spec: ModelSpec | None, tp_plan: dict | None, pipeline: StageLayout | None,
              layout: Layout, recompute: str | tuple[Target, ...]) -> None:
    """Every setting that cannot run, as one line with the fix, before any weight is touched: what the API
    needs to know of a model it did not write, then the layout's rules (:func:`trainmesh.layout.validate`)
    on the model's shape where its family gives one."""
    name, tp, pp, cp, ep = type(model).__name__, mesh.size("tp"), mesh.size("pp"), mesh.size("cp"), mesh.size("ep")
    if isinstance(recompute, str) and recompute != "none" and spec is None:
        raise ValueError(f"recompute={recompute!r} needs the model's family to name its blocks; pass the "
                         f"block classes instead, e.g. recompute=(MyBlock,)")
    if tp > 1 and tp_plan is None:
        raise ValueError(f"tp={tp} needs a tp_plan (module-name patterns -> styles, e.g. tm.tp_plans.llama) for {name}")
    if pp > 1 and pipeline is None and not _keeps_contract(model) and (spec is None or spec.layout is None):
        raise ValueError(f"pp={pp} needs to know where {name} keeps its blocks; pass "
                         f"pipeline=tm.StageLayout(blocks='layers', pre='embed', post=('norm', 'head'), "
                         f"hidden_size=...)")
    if pp > 1 and not _hidden_size(model, spec, pipeline):
        raise ValueError(f"pp={pp} passes [batch, seq, hidden] activations between stages; give "
                         f"StageLayout(hidden_size=...) for {name}")
    if cp > 1 and (spec is None or not spec.cp_plan):
        raise ValueError(f"cp={cp} needs to know where {name} computes attention and takes positions; context "
                         f"parallelism splits the built-in families (gpt, llama)")
    if layout.precision == "fp8":
        _validate_float8(name, spec, mesh.device)
    if mesh.experts_over_tp and not layout.sequence_parallel:
        raise ValueError("the mesh's ep groups fold over tp (tm.init_mesh(..., sequence_parallel=True)), so each tp "
                         "rank must hold its own tokens: pass sequence_parallel=True to parallelize, or build the "
                         "mesh without it")
    if spec is None and ep > 1:  # no shape: the experts are counted from the modules that hold them
        layers = expert_modules(model)
        problem = experts_problem(ep, layers[0][1].experts.w1.shape[0] if layers else 0, keyword, name)
        if problem:
            raise ValueError(problem)
    validate(layout, spec.shape(spec.config_of(model)) if spec is not None else None, name=name)


def _validate_float8(name: str, spec: ModelSpec | None, device: torch.device) -> None:
    """fp8 needs torchao, FP8 tensor cores (or a CPU) and the family's list of layers kept in bf16."""
    problem = fp8_problem(device_capability(device), "precision='fp8'")
    if problem:
        raise ValueError(problem)
    if spec is None or not spec.high_precision:
        raise ValueError(f"precision='fp8' needs the model's family to name the layers that stay bf16 "
                         f"(ModelSpec.high_precision: embedding, head, router), and {name} has none; use "
                         f"precision='bf16'")


def parallelize(model: nn.Module, mesh: Mesh, *, tp_plan: dict[str, str] | None = None,
                sequence_parallel: bool = False, zero: int = 0, recompute: str | tuple[Target, ...] = "none",
                pipeline: StageLayout | None = None, schedule: str = "1f1b", microbatches: int = 1,
                virtual_stages: int = 1, stage_layers: Sequence[int] = (), precision: str = "fp32",
                reduce_dtype: str = "auto", bucket_mb: float = 25.0, compile: bool = False,
                cuda_graphs: bool = False, cp_impl: str = "ring", comm: Comm | None = None) -> ParallelModel:
    """Apply the parallel forms of ``mesh`` to ``model`` (in place: use the returned model from now on).

    Every rank must pass the same model. A model presented through a :class:`StageLayout` then refuses its
    own forward and ``state_dict`` (both would see shards); a transformers object of a family read only through
    its HF mapping is converted (``tm.from_hf``). Arguments (``tp_plan``, ``zero``, ``recompute``, ``pipeline``,
    ``precision``, ``compile``, ``cp_impl``) and ep's expert groups: docs/api.md."""
    model = as_trainmesh(model)
    spec = spec_for(model)
    _refuse_foreign(model, spec)
    plan = tp_plan if tp_plan is not None else (dict(spec.tp_plan) if spec is not None and mesh.size("tp") > 1 else None)
    plan = moe_tp_plan(plan, model, sequence_parallel, mesh.experts_over_tp) if plan is not None else None
    layout = Layout(**{axis: mesh.size(axis) for axis in MESH_SIZES},
                    zero=zero, sequence_parallel=sequence_parallel, schedule=schedule, virtual_stages=virtual_stages,
                    microbatches=microbatches, stage_layers=tuple(stage_layers),
                    recompute=recompute if isinstance(recompute, str) else "none",  # classes: no mode to check
                    precision=precision, reduce_dtype=reduce_dtype, cp_impl=cp_impl, bucket_mb=bucket_mb,
                    compile=compile, cuda_graphs=cuda_graphs)
    _validate(model, mesh, spec, plan, pipeline, layout, recompute)
    comm = comm or Comm(mesh)
    hidden = _hidden_size(model, spec, pipeline)
    description = checkpoint.describe_model(model)
    model = _staged(model, spec, pipeline).to(mesh.device, dtype_of(precision))
    if precision == "fp8":
        convert_to_float8(model, spec.high_precision)
    apply_expert_parallel(model, comm, mesh.experts_over_tp)
    criterion = apply_tensor_parallel(model, mesh, dict(plan or {}), sequence_parallel, comm)
    split_axes = tuple(axis for axis, on in (("tp", sequence_parallel), ("cp", True)) if on and mesh.size(axis) > 1)
    if split_axes:
        split_sequence_stats(model, comm, split_axes)
    if mesh.size("cp") > 1:
        apply_context_parallel(model, spec.cp_plan, comm, spec.shape(spec.config_of(model)).seq_len, cp_impl)
    if isinstance(recompute, str):
        apply_recompute(model, recompute, spec.recompute if spec is not None else {})
    else:
        recompute_modules(model, tuple(recompute))
    mode = _compile_mode(model, mesh, layout) if cuda_graphs else PLAIN_MODE
    if compile:
        for block in model.blocks.values():
            # The forward, not the module's call: the hooks other forms put around a block (ZeRO-3's
            # gather and free, the zero-bubble schedule's) communicate and keep Python records, which
            # Dynamo would trace, break its graph on and recompile for; they run eagerly around it.
            block.forward = torch.compile(block.forward, mode=mode)
    loss = criterion or cross_entropy
    if compile and criterion is None:
        # Fused into one pass over the logits each way: eager upcasts bf16 logits to an fp32 copy, then
        # reads and writes fp32 tensors of that size again for the softmax and for its gradient.
        loss = torch.compile(loss, mode=mode)
    runtime = None
    if mesh.size("pp") > 1:
        model, runtime = build_pipeline(model, comm, schedule, microbatches, hidden,
                                        dtype_of(precision), virtual_stages, tuple(stage_layers),
                                        seq_shards=mesh.size("tp") if sequence_parallel else 1)
    return ParallelModel(model, mesh, comm, loss, criterion is not None, layout, runtime, description=description,
                         documents=spec is not None and spec.documents)


def _compile_mode(model: nn.Module, mesh: Mesh, layout: Layout) -> str:
    """The ``torch.compile`` mode of a run that asked for CUDA graphs; where they cannot capture this layout,
    rank 0 says why, once."""
    mode, why = compile_mode(layout, mesh.device.type, moe=bool(expert_modules(model)))
    if why and mesh.global_rank() == 0:
        print(f"trainmesh: compiling without CUDA graphs: {why}", file=sys.stderr, flush=True)
    return mode


def _hidden_size(model: nn.Module, spec: ModelSpec | None, pipeline: StageLayout | None) -> int:
    """The width of the activations a pipeline passes between stages: the family's ``d_model``, else the
    :class:`StageLayout`'s ``hidden_size`` (0: unknown)."""
    if spec is not None:
        return spec.shape(spec.config_of(model)).d_model
    return pipeline.hidden_size if pipeline is not None else 0


def _zero3_units(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """ZeRO-3's units for a :class:`Staged` model, in forward order: the embedding, each block, the final
    norm, the head (the default, one unit per top-level child, would make the whole body one unit)."""
    if not isinstance(module, Staged):
        return None
    paths = module._paths
    units = [(paths["embed"], module.embed)] if module.embed not in (None, module.head) else []  # a tied last stage
    units += [(f"{paths['blocks']}.{k}", block) for k, block in module.blocks.items()]
    units += [(paths[p], getattr(module, p)) for p in ("ln_f", "head") if getattr(module, p) is not None]
    return [(name, m) for name, m in units if any(p.requires_grad for p in m.parameters())]


@dataclass(eq=False)
class Optimizer:
    """AdamW over what this rank holds, driven through the model's engine (data parallelism or ZeRO). ``lr``:
    what the next :func:`train_step` uses; ``grad_norm``: the last step's global norm before clipping;
    ``trained_tokens``: the last step's trained tokens in the global batch."""

    engine: object
    lr: float
    grad_norm: float = math.nan
    trained_tokens: int = 0

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer


def optimizer(model: ParallelModel, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.95),
              weight_decay: float = 0.1) -> Optimizer:
    """AdamW for ``model`` (weight decay on matrices only, not on biases and norm gains; eps 1e-8), with
    the gradient synchronisation of its layout: bucketed all-reduce over dp, or ZeRO stage ``model.layout.zero``,
    whose optimizer state (and gradients, and parameters) are sharded over dp. Call once, before training."""
    if model.engine is not None:
        raise RuntimeError("this model already has an optimizer; call trainmesh.optimizer once per model")
    make_optimizer = adamw_factory(model.mesh.device, lr, betas, weight_decay)
    layout = model.layout
    args = dict(bucket_bytes=layout.bucket_bytes, reduce_dtype=dtype_of(resolve_reduce_dtype(layout.precision,
                                                                                              layout.reduce_dtype)),
                scaler=LossScaler(enabled=layout.precision == "fp16"), axis=_sharding_axis(model.mesh))
    units = _zero3_units(model.module)
    if layout.zero == 3 and units is not None:
        model.engine = zero.ZeroStage3(model.module, model.comm, make_optimizer, **args, units=units)
    else:
        model.engine = zero.build_engine(model.module, model.comm, layout.zero, make_optimizer, **args)
    return Optimizer(model.engine, lr)


def _sharding_axis(mesh: Mesh) -> str:
    """Where ZeRO shards and gradients are reduced: ``dp``, ``dp_cp`` under context parallelism, and under
    hybrid sharding the ``dp_shard`` group inside a replica (the engine adds the all-reduce across replicas)."""
    if mesh.size(REPLICA_AXIS) > 1:
        return SHARD_AXIS
    return GRAD_AXIS if mesh.size("cp") > 1 else "dp"


def forward_backward(module: nn.Module, engine: Engine, pipeline: PipelineRuntime | None,
                     micro_batches: MicroBatches, criterion: Criterion, saved=None,
                     divisors: Sequence[float] | None = None) -> torch.Tensor:
    """Accumulate gradients of the loss over ``micro_batches`` (each inside its packed documents, if it has them:
    forward and backward, so recomputation sees them too), synchronising only after the last; returns this rank's
    share of the loss (0 on stages without the head), MoE aux losses included. Micro-batch ``i``'s mean over its
    trained tokens is divided by ``divisors[i]`` (:func:`~trainmesh.training.loss.divisors`; default: the
    micro-batch count, a mean of means). ``saved``, if given, records the first micro-batch's activation bytes."""
    divisors = divisors or [len(micro_batches)] * len(micro_batches)
    moe.begin_step(module, engine.loss_scale / len(micro_batches))
    if pipeline is not None:
        loss = pipeline.forward_backward(micro_batches, criterion, engine, saved, divisors)
        return loss + moe.aux_loss_total(module) / len(micro_batches)
    total = torch.zeros((), dtype=torch.float64)
    for i, (x, y, *packing) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else engine.no_sync(), packed(*packing):
            with saved.recording() if saved is not None and i == 0 else contextlib.nullcontext():
                loss = micro_loss(criterion, module(x), y, divisors[i])
            (loss * engine.loss_scale).backward()
        total = total.to(loss.device) + loss.detach()
    return total + moe.aux_loss_total(module) / len(micro_batches)


def token_divisors(mesh: Mesh, micro_batches: MicroBatches,
                   global_targets: torch.Tensor | None = None) -> tuple[list[float], int]:
    """Each of this rank's micro-batches' loss divisor (:func:`~trainmesh.training.loss.divisors`) and the
    global batch's trained-token count: counted from ``global_targets`` where given, else summed over dp x cp
    (one small all-reduce). The micro-batches' counts are read in one host sync, before the step computes."""
    counts = torch.stack([trained_count(mb[1]) for mb in micro_batches]).tolist()
    if global_targets is None:
        total = int(sum_over_data(mesh, torch.tensor([sum(counts)], dtype=torch.int64), "trained_tokens").item())
    else:
        total = int(trained_count(global_targets))
    return loss_divisors(counts, total, mesh.size("dp") * mesh.size("cp")), total


def sum_over_data(mesh: Mesh, values: torch.Tensor, op: str) -> torch.Tensor:
    """``values`` summed over the ranks that hold the same layers and saw other tokens (dp x cp): tp ranks
    route the same tokens and pipeline stages hold other layers, so neither is summed over; ``op`` names it."""
    if mesh.size(GRAD_AXIS) == 1:
        return values
    return log_all_reduce(values.to(mesh.device), group=mesh.group(GRAD_AXIS), op=op, axis=GRAD_AXIS)


def update_routing(module: nn.Module, mesh: Mesh) -> None:
    """After an optimizer step: the aux-loss-free bias update of every MoE layer (DeepSeek-V3), from the
    step's per-expert counts summed over the data-parallel ranks (:func:`sum_over_data`)."""
    moe.update_expert_bias(module, lambda counts: sum_over_data(mesh, counts, "expert_counts"))


def global_mean(mesh: Mesh, value: torch.Tensor) -> float:
    """Mean over data-parallel ranks of a loss that each tp rank holds a copy of and only the last
    pipeline stage computes (the other stages pass zero); each dp x cp rank's share is its micro-batches'
    losses over their divisors (:func:`token_divisors`), which the ranks' mean makes the mean over every
    trained token of the global batch: the value one process computes."""
    total = log_all_reduce(value.detach().double().reshape(1).clone())
    return total.item() / (mesh.size("dp") * mesh.size("cp") * mesh.size("tp"))


def rank_slice(mesh: Mesh, batch: tuple[torch.Tensor, ...], microbatches: int,
               dp_sliced: bool = False) -> MicroBatches:
    """This rank's micro-batches of a global batch ``(inputs, targets)`` or ``(inputs, targets, documents)``: its dp
    slice of the sequences (the batch is that slice already with ``dp_sliced``, as a data loader that reads only this
    rank's share gives it), its head-tail cp part of each (with documents, the chunks :func:`balanced_shards` gives
    it), on the mesh's device; with documents each micro-batch carries its :class:`Packing`."""
    x, y, *documents = batch
    dp = 1 if dp_sliced else mesh.size("dp")
    if x.shape[0] % (dp * microbatches):
        what = "this rank's slice of" if dp_sliced else "a global batch of"
        raise ValueError(f"{what} {x.shape[0]} sequences does not split into dp={dp} x "
                         f"microbatches={microbatches}; use a multiple of {dp * microbatches}")
    if documents and documents[0].shape != x.shape:
        raise ValueError(f"documents have shape {tuple(documents[0].shape)} but the inputs {tuple(x.shape)}; give "
                         f"each input token's document index")
    if documents and bool((documents[0].diff(dim=1) < 0).any()):
        raise ValueError("documents decrease along a sequence; give each token the index of its document in the "
                         "window, non-decreasing (trainmesh.data.documents_from_eos makes them)")
    if not dp_sliced:
        x, y, *documents = (t.chunk(dp)[mesh.rank("dp")] for t in (x, y, *documents))
    if documents:
        return [_packed_micro_batch(mesh, *parts) for parts in zip(x.chunk(microbatches), y.chunk(microbatches),
                                                                  documents[0].chunk(microbatches))]
    x, y = (shard_sequence(t, mesh.size("cp"), mesh.rank("cp")) for t in (x, y))
    x, y = _to_device(mesh, x), _to_device(mesh, y)
    return list(zip(x.chunk(microbatches), y.chunk(microbatches)))


def _to_device(mesh: Mesh, t: torch.Tensor) -> torch.Tensor:
    if mesh.device.type == "cuda":
        return t.pin_memory().to(mesh.device, non_blocking=True)
    return t.to(mesh.device)


def _packed_micro_batch(mesh: Mesh, x: torch.Tensor, y: torch.Tensor,
                        documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """One micro-batch of packed documents: under cp this rank's chunks of it (balanced by attention work, the same
    on every cp rank since they see the same documents), each token's position in its document, the packing."""
    documents = documents.long()
    positions = document_positions(documents)
    cp = mesh.size("cp")
    shards, chunk = balanced_shards(documents, cp) if cp > 1 else ((), 0)
    if shards:
        held = held_positions(shards[mesh.rank("cp")], chunk)
        x, y, positions = (t.index_select(1, held) for t in (x, y, positions))
    packing = Packing(_to_device(mesh, documents), _to_device(mesh, positions), shards, chunk)
    return _to_device(mesh, x), _to_device(mesh, y), packing


def refuse_documents(model: ParallelModel) -> None:
    """A batch of packed documents for a model that would ignore them (attention would cross documents), or
    one compiled (its traced blocks would hold one micro-batch's documents), refused in one line."""
    if not model.documents:
        families = ", ".join(s.family for s in SPECS if s.documents)
        raise ValueError(f"{type(model.module).__name__}'s attention does not read packed documents, so it would "
                         f"attend across them; pass (inputs, targets) without documents, or train a family that "
                         f"reads them ({families})")
    if model.layout.compile:
        raise ValueError("packed documents change every micro-batch's masks and positions, which compiled blocks "
                         "do not follow; train them with compile=False")


def train_step(model: ParallelModel, opt: Optimizer, batch: tuple[torch.Tensor, ...],
               loss_fn: Criterion | None = None, microbatches: int | None = None, max_norm: float = 0.0, *,
               dp_sliced: bool = False, saved=None) -> float:
    """One optimizer step on the global ``batch`` = ``(inputs, targets)`` or ``(inputs, targets, documents)`` (packed
    documents: ``[batch, seq]`` document index of each input token), or this dp rank's slice with ``dp_sliced``:
    micro-batches, clipping to ``max_norm``, AdamW at ``opt.lr``. Returns the mean loss over the batch's trained
    tokens (targets not -100), the value one process computes in any layout; ``opt.trained_tokens`` counts them,
    ``opt.grad_norm`` not finite means the step was skipped on every rank. See docs/api.md."""
    if opt.engine is not model.engine:
        raise ValueError("opt was not made for this model; pass the optimizer trainmesh.optimizer(model) returned")
    if loss_fn is not None and model.vocab_parallel:
        raise ValueError("the tp plan splits the output head by vocabulary, so each rank holds a slice of the "
                         "logits; use the default loss (loss_fn=None) or give the head another style")
    m = microbatches or model.layout.microbatches
    if model.pipeline is not None and m != model.layout.microbatches:
        raise ValueError(f"the pipeline schedule was built for {model.layout.microbatches} micro-batches; pass "
                         f"microbatches={m} to parallelize instead")
    if model.engine is None:
        raise RuntimeError("the model has no optimizer yet; call trainmesh.optimizer(model) first")
    if len(batch) == 3:
        refuse_documents(model)
    micro_batches = rank_slice(model.mesh, batch, m, dp_sliced)
    shares, opt.trained_tokens = token_divisors(model.mesh, micro_batches, None if dp_sliced else batch[1])
    loss = forward_backward(model.module, model.engine, model.pipeline, micro_batches, loss_fn or model.criterion,
                            saved, shares)
    opt.grad_norm = model.engine.step(opt.lr, max_norm)
    if math.isfinite(opt.grad_norm):
        update_routing(model.module, model.mesh)
    return global_mean(model.mesh, loss)


def full_state_dict(module: nn.Module, engine: Engine | None, comm: Comm, pipelined: bool) -> dict[str, torch.Tensor]:
    """The ordinary unsharded parameters under the plain model's names, on every rank (a collective): what a
    user exports and what the equivalence tests compare."""
    with engine.gathered() if engine is not None else contextlib.nullcontext():
        state = {k: v.detach().clone() for k, v in unsharded_state_dict(module).items()}
        state = gather_experts(state, module, {axis: comm.mesh.group(axis) for axis in ("ep", "etp")})
    return gather_stages(state, comm) if pipelined else state


def save(model: ParallelModel, opt: Optimizer, directory: str | Path, step: int | checkpoint.TrainingProgress,
         tokenizer: str | TokenizerFile | None = "", keep_last: int = 0, *, async_: bool = False,
         config: dict | None = None, hf_source: str = "") -> Path | AsyncSave:
    """Save model and optimizer state as ``directory/step-N`` (a collective: each rank writes what it holds) and
    point ``latest`` at it; returns the step directory, or with ``async_`` an :class:`AsyncSave` handle whose
    ``wait()`` (a collective) must come before relying on it. The model holds ``directory``'s run lock from its
    first save. Arguments (``keep_last``, ``hf_source``, ``config``, ...): docs/api.md."""
    if opt.engine is not model.engine:
        raise ValueError("opt was not made for this model; pass the optimizer trainmesh.optimizer(model) returned")
    root, mesh, previous = Path(directory), model.mesh, model.pending_save
    if previous is not None and not async_:
        previous.wait()
        model.pending_save = previous = None
    progress = step if isinstance(step, checkpoint.TrainingProgress) else checkpoint.TrainingProgress(step)
    if not progress.run_id:
        progress = dataclasses.replace(progress, run_id=agreed_run_id(mesh.device))
    hold_directory(model, root, progress.run_id)
    description = describe(model, tokenizer, config, hf_source)
    if async_:
        model.pending_save = save_state_async(model.module, model.engine, mesh, root, progress, description, previous,
                                              keep_last)
        return model.pending_save
    return checkpoint.save_state(model.module, model.engine, mesh, root, progress, description, keep_last=keep_last)


def describe(model: ParallelModel, tokenizer: str | TokenizerFile | None = "", config: dict | None = None,
             hf_source: str = "") -> dict:
    """What a manifest records besides the tensors (:func:`save`'s arguments): the model, the run's settings,
    the tokenizer, the layout (:meth:`~trainmesh.layout.Layout.record`, as a run log's records name it) and, on
    rank 0 (which publishes), the files of ``hf_source`` the checkpoint keeps."""
    pinned = TokenizerFile.read(tokenizer) if isinstance(tokenizer, str) and tokenizer else tokenizer or None
    family_config, source = model.description
    return {"model": family_config, "model_source": source, "tokenizer": pinned, "layout": model.layout.record(),
            "config": {"model": "", "tokenizer": pinned.source if pinned else ""} if config is None else config,
            "hf_files": _kept_source(hf_source) if hf_source and world_env().rank == 0 else {}}


@functools.cache
def _kept_source(directory: str) -> dict[str, KeptFile]:
    """The source's files, read at the first save only: every checkpoint of the run keeps the same bytes."""
    return hf_extras.collect(Path(directory))


def hold_directory(model: ParallelModel, root: Path, run_id: str) -> None:
    """Rank 0 takes ``root``'s lock for ``model``'s life, once, noting ``run_id``; a collective that raises
    :class:`~trainmesh.checkpoint.CheckpointError` on every rank if another live run holds it. A lock held for
    ``run_id`` (by this process or another) is the run's already: ``trainmesh train`` takes it once, in the
    process that launches the ranks, and its ranks save under it."""
    if root.resolve() in model.saves_to:
        return
    held = contextlib.ExitStack()

    def take() -> None:
        if world_env().rank != 0:
            return
        try:
            root.mkdir(parents=True, exist_ok=True)
            held.enter_context(runlock.hold(root, "directory", checkpoint.LOCK)).note(run_id=run_id)
        except runlock.DirectoryInUse as e:
            pid, run = e.holder.get("pid"), e.holder.get("run_id")
            if run == run_id:
                return
            whose = (" (this process)" if pid == os.getpid() else "") + (f", run {show(run)}" if run else "")
            raise checkpoint.CheckpointError(
                f"checkpoint directory {root} is in use by another live run: pid {show(pid)} on host "
                f"{show(e.holder.get('host'))}{whose}; wait for it to end, stop it, or save to another "
                f"directory") from None
        except OSError as e:
            raise checkpoint.CheckpointError(f"checkpoint directory {root} cannot be used: {e}") from None

    checkpoint.on_every_rank(take, model.mesh.device, f"locking checkpoint directory {root}")
    weakref.finalize(model, held.close)
    model.saves_to.add(root.resolve())


def load(model: ParallelModel, opt: Optimizer, directory: str | Path, *, run_id: str = "",
         accept: Callable[[dict, Path], None] = lambda manifest, path: None) -> int:
    """Load the newest sound checkpoint of any layout from ``directory`` (``step-N`` or its parent: ``latest``,
    then older, damaged ones skipped) into ``model`` and ``opt``; returns its step. A collective. ``run_id``
    and ``accept`` filter checkpoints (docs/api.md)."""
    if opt.engine is not model.engine:
        raise ValueError("opt was not made for this model; pass the optimizer trainmesh.optimizer(model) returned")
    if model.pending_save is not None:
        model.pending_save.wait()
        model.pending_save = None
    return checkpoint.load_newest(model.module, model.engine, model.mesh, Path(directory), run_id, accept).step
