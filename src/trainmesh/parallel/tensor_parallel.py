"""Tensor parallelism: layers split over the ``tp`` axis, applied to a plain model by a plan.

Megatron-LM (Shoeybi et al., 2019, §3): column- then row-parallel linears joined by the conjugate ``f``/``g``,
vocabulary-split embedding, head and loss. Sequence parallelism (Korthikanti et al., 2022, §4.2.2) makes ``f``/``g``
all-gather/reduce-scatter and sums the gradients of replicated parameters between them over tp. A plan maps
module-name patterns to :data:`STYLES`; activations are ``[batch, seq, hidden]``."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainmesh.distributed.comm import Comm, Pending
from trainmesh.distributed.mesh import Mesh
from trainmesh.training.float8 import tp_float8_matmul
from trainmesh.training.loss import IGNORE_INDEX
from trainmesh.training.optim import TP_SHARDED
from trainmesh.training.precision import master_dtype

AXIS = "tp"
SEQ_DIM = -2

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Plan = dict[str, str]


# --- collectives along a tensor dimension ------------------------------------------------------------

def _split(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """This rank's 1/tp slice of ``x`` along ``dim``."""
    return x.chunk(comm.mesh.size(AXIS), dim)[comm.mesh.rank(AXIS)].contiguous()


def _launch_all_gather(x: torch.Tensor, dim: int, comm: Comm, op: str = "all_gather") -> tuple[torch.Tensor, Pending]:
    """Start concatenating every tp rank's ``x`` along ``dim``, in rank order (valid once waited on)."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((comm.mesh.size(AXIS) * x.shape[0], *x.shape[1:]))
    return out.movedim(0, dim), comm.all_gather(out, x, AXIS, op=op, async_op=True)


def _launch_reduce_scatter(x: torch.Tensor, dim: int, comm: Comm) -> tuple[torch.Tensor, Pending]:
    """Start summing ``x`` over tp ranks, keeping this rank's 1/tp slice along ``dim`` (valid once waited on)."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // comm.mesh.size(AXIS), *x.shape[1:]))
    return out.movedim(0, dim), comm.reduce_scatter(out, x, AXIS, async_op=True)


def _all_gather(x: torch.Tensor, dim: int, comm: Comm, op: str = "all_gather") -> torch.Tensor:
    out, work = _launch_all_gather(x, dim, comm, op)
    work.wait()
    return out


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    out, work = _launch_reduce_scatter(x, dim, comm)
    work.wait()
    return out


def _all_reduce(x: torch.Tensor, comm: Comm, op: str = "all_reduce") -> torch.Tensor:
    """A summed copy of ``x``: neither a Function's input nor the gradient a hook receives may be modified."""
    x = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(x, AXIS, op=op)
    return x


# --- autograd-aware collectives (Megatron's mappings.py) ---------------------------------------------

class _ReduceFromTP(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward (after a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Sequence-parallel ``g``: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _reduce_scatter(x, SEQ_DIM, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, SEQ_DIM, ctx.comm), None


class _ScatterToSequence(torch.autograd.Function):
    """Entering the sequence-parallel region: split along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _split(x, SEQ_DIM, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, SEQ_DIM, ctx.comm), None


class _CopyToTP(torch.autograd.Function):
    """``f`` on its own: identity forward, all-reduce backward (entering a region of local column shards)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.comm), None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence-parallel ``f`` on its own: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _all_gather(x, SEQ_DIM, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, SEQ_DIM, ctx.comm), None


class _ColumnParallelLinear(torch.autograd.Function):
    """``f`` fused with the linear: forward ``x A^T + b`` (all-gathering ``x`` under SP); backward all-reduces
    (reduce-scatters under SP) the input gradient while the weight gradient is computed, as Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``. Under SP only the local slice is saved [KOR, 4.2.2]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                sequence_parallel: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.sequence_parallel, ctx.has_bias = comm, sequence_parallel, bias is not None
        return F.linear(_all_gather(x, SEQ_DIM, comm) if sequence_parallel else x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        if ctx.sequence_parallel:
            x, gather = _launch_all_gather(x, SEQ_DIM, ctx.comm)
        grad_x = grad @ weight
        if ctx.sequence_parallel:
            gather.wait()
            grad_x, work = _launch_reduce_scatter(grad_x, SEQ_DIM, ctx.comm)
        else:
            work = ctx.comm.all_reduce(grad_x, AXIS, async_op=True)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t() @ x.reshape(-1, x.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        work.wait()
        return grad_x, grad_weight, grad_bias, None, None


def _row_parallel_output(x: torch.Tensor, comm: Comm, sequence_parallel: bool) -> torch.Tensor:
    """The output of a row-parallel layer: partial sums reduced (and split along the sequence under SP)."""
    return (_ReduceScatterToSequence if sequence_parallel else _ReduceFromTP).apply(x, comm)


TP_PARTIAL = "_trainmesh_tp_partial"
"""On a replicated parameter whose gradient each tp rank holds only its part of: ``"backward"`` while every
backward's part is summed over tp by a hook (:func:`sum_grad_over_tp`), ``"step"`` once a gradient engine
sums the accumulated gradient over tp itself, once per step (:func:`defer_tp_sums`)."""


def sum_grad_over_tp(p: nn.Parameter, comm: Comm) -> None:
    """Make ``p``'s gradient the sum over tp ranks: a replicated parameter in the SP region sees only its slice
    of the sequence. Summed per backward unless an engine takes it over (:func:`defer_tp_sums`)."""
    setattr(p, TP_PARTIAL, "backward")
    p.register_hook(lambda grad: grad if getattr(p, TP_PARTIAL) == "step" else _all_reduce(grad, comm, op="sequence_grads"))


def defer_tp_sums(params: Sequence[nn.Parameter]) -> bool:
    """Whether an engine should sum ``params`` (one bucket) over tp itself once per step, turning off their
    per-backward hooks. The sum commutes with accumulation and dp reduction, which saves one all-reduce per
    micro-batch of the routed experts' gradients under SP. Only buckets of such parameters alone qualify."""
    if not params or not all(getattr(p, TP_PARTIAL, None) for p in params):
        return False
    for p in params:
        setattr(p, TP_PARTIAL, "step")
    return True


def is_tp_partial(p: nn.Parameter) -> bool:
    """Whether ``p``'s gradient is summed over tp (see :data:`TP_PARTIAL`)."""
    return getattr(p, TP_PARTIAL, None) is not None


# --- how a parameter is split ------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardSpec:
    """Split along ``dim``; with ``chunks > 1`` (a fused ``[q | k | v]`` weight) each chunk is split alike."""

    dim: int
    chunks: int = 1


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full``: its 1/size of every chunk, concatenated."""
    parts = [chunk.chunk(size, spec.dim)[rank] for chunk in full.chunk(spec.chunks, spec.dim)]
    return torch.cat(parts, spec.dim).contiguous()


def gather_tensor(local: torch.Tensor, spec: ShardSpec, comm: Comm) -> torch.Tensor:
    """The inverse of :func:`shard_tensor`, assembled from every tp rank (a collective)."""
    size = comm.mesh.size(AXIS)
    per_rank = _all_gather(local, spec.dim, comm, op="unshard").chunk(size, spec.dim)
    pieces = [shard.chunk(spec.chunks, spec.dim) for shard in per_rank]
    return torch.cat([pieces[r][c] for c in range(spec.chunks) for r in range(size)], spec.dim)


# --- tensor-parallel layers --------------------------------------------------------------------------

class ShardedModule(nn.Module):
    """A layer whose parameters are split over tp; it can cut its shards from full tensors and
    reassemble them, under the same parameter names as the plain layer it replaces."""

    def __init__(self, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.specs: dict[str, ShardSpec] = {}
        self.float8: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def _adopt(self, name: str, full: torch.Tensor | None, spec: ShardSpec | None) -> None:
        """Register this rank's part of ``full`` as parameter ``name`` (all of it when ``spec`` is None)."""
        if full is None:
            self.register_parameter(name, None)
            return
        data = full.detach() if spec is None else shard_tensor(full.detach(), spec, *self._coords())
        p = nn.Parameter(data.clone(), requires_grad=full.requires_grad)
        if spec is not None:
            setattr(p, TP_SHARDED, True)
            self.specs[name] = spec
        self.register_parameter(name, p)

    def _adopt_linear(self, linear: nn.Linear, weight: ShardSpec, bias: ShardSpec | None) -> None:
        """Adopt a linear's weight and bias; a float8 linear's shard multiplies in float8 with one process's scales."""
        self._adopt("weight", linear.weight, weight)
        self._adopt("bias", linear.bias, bias)
        self.float8 = tp_float8_matmul(linear, self.weight, self.comm)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight^T (+ bias)`` on this rank's shard, in float8 where :meth:`_adopt_linear` chose it."""
        if self.float8 is None:
            return F.linear(x, self.weight, bias)
        y = self.float8(x, self.weight)
        return y if bias is None else y + bias

    def _coords(self) -> tuple[int, int]:
        return self.comm.mesh.rank(AXIS), self.comm.mesh.size(AXIS)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor of parameter ``name``."""
        return shard_tensor(full, self.specs[name], *self._coords())

    def unshard(self, name: str) -> torch.Tensor:
        """The full tensor of parameter ``name``, gathered from every tp rank (a collective)."""
        return gather_tensor(getattr(self, name).detach(), self.specs[name], self.comm)


class ColumnParallelLinear(ShardedModule):
    """``y = x A^T + b`` split by output features (output stays split); ``chunks=3`` shards a fused qkv per head."""

    def __init__(self, linear: nn.Linear, comm: Comm, sequence_parallel: bool, chunks: int = 1) -> None:
        super().__init__(comm, sequence_parallel)
        self._adopt_linear(linear, ShardSpec(0, chunks), ShardSpec(0, chunks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8 is None:
            return _ColumnParallelLinear.apply(x, self.weight, self.bias, self.comm, self.sequence_parallel)
        entry = _GatherFromSequence if self.sequence_parallel else _CopyToTP  # float8: whole input, then the matmul
        return self._linear(entry.apply(x, self.comm), self.bias)


class LocalColumnLinear(ShardedModule):
    """A column-parallel linear whose input the module's ``prepare_input`` already made whole: no communication
    of its own (as torchtitan's ``PrepareModuleInput`` for separate q/k/v)."""

    def __init__(self, linear: nn.Linear, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__(comm, sequence_parallel)
        self._adopt_linear(linear, ShardSpec(0), ShardSpec(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class RowParallelLinear(ShardedModule):
    """``y = x A^T + b`` with ``A`` split by input features (``x`` arrives split); partial products are
    reduced, then the replicated bias is added once."""

    def __init__(self, linear: nn.Linear, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__(comm, sequence_parallel)
        self._adopt_linear(linear, ShardSpec(1), None)
        if sequence_parallel and self.bias is not None:
            sum_grad_over_tp(self.bias, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _row_parallel_output(self._linear(x), self.comm, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(ShardedModule):
    """An embedding table split by rows (vocabulary): each rank looks up the ids in its range, zeros the
    rest, and the partial embeddings are summed (Megatron-LM §3)."""

    def __init__(self, embedding: nn.Embedding, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__(comm, sequence_parallel)
        self._adopt("weight", embedding.weight, ShardSpec(0))
        self.scale = getattr(embedding, "scale", None)  # a scaled table's factor (Gemma's sqrt(d_model))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.comm.mesh.rank(AXIS) * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=out.dtype)
        return _row_parallel_output(out, self.comm, self.sequence_parallel)


# --- the vocabulary-parallel loss --------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token cross-entropy from vocabulary-split logits with two all-reduces (the max, then
    the target logit and the sum of exponentials); backward: local ``softmax - onehot``, no communication."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.to(master_dtype(logits.dtype))
        vocab = logits.shape[-1]
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, AXIS, op="cross_entropy", reduce_op=dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        local = targets - comm.mesh.rank(AXIS) * vocab
        outside = (local < 0) | (local >= vocab)
        local = local.masked_fill(outside, 0)
        exp = shifted.exp()
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        comm.all_reduce(sums, AXIS, op="cross_entropy")
        ctx.save_for_backward(exp.div_(sums[1].unsqueeze(-1)), local, outside)
        return sums[1].log() - sums[0]

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        onehot = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad = softmax.scatter_add_(-1, local.unsqueeze(-1), -onehot)
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Mean next-token loss over the trained targets (not :data:`IGNORE_INDEX`) from logits whose last dimension
    is split over tp; every tp rank gets it. An untrained token's loss is zeroed, so its gradient is zero."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    per_token = _VocabParallelCrossEntropy.apply(flat, targets, comm)
    trained = targets != IGNORE_INDEX
    return per_token.masked_fill(~trained, 0.0).sum() / trained.sum()


# --- styles and the plan -----------------------------------------------------------------------------

def _require(module: nn.Module, kinds: tuple[type, ...], name: str, style: str) -> None:
    if not isinstance(module, kinds):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"plan style {style!r} applies to {wanted}, but {name} is a {type(module).__name__}; "
                        f"fix the pattern that matches {name}")


def _require_divisible(size: int, tp: int, what: str, name: str, fix: str = "") -> None:
    if size % tp:
        raise ValueError(f"tp={tp} does not divide {what}={size} of {name}; choose tp dividing {size}{fix}")


def _colwise(module: nn.Module, name: str, comm: Comm, sp: bool, chunks: int = 1) -> nn.Module:
    _require(module, (nn.Linear,), name, "colwise")
    what = "out_features" if chunks == 1 else f"out_features/{chunks}"
    _require_divisible(module.out_features // chunks, comm.mesh.size(AXIS), what, name)
    return ColumnParallelLinear(module, comm, sp, chunks)


def _rowwise(module: nn.Module, name: str, comm: Comm, sp: bool) -> nn.Module:
    _require(module, (nn.Linear,), name, "rowwise")
    _require_divisible(module.in_features, comm.mesh.size(AXIS), "in_features", name)
    return RowParallelLinear(module, comm, sp)


def _colwise_local(module: nn.Module, name: str, comm: Comm, sp: bool) -> nn.Module:
    _require(module, (nn.Linear,), name, "colwise_local")
    _require_divisible(module.out_features, comm.mesh.size(AXIS), "out_features", name)
    return LocalColumnLinear(module, comm, sp)


def _first_input(args: tuple, kwargs: dict) -> tuple[str | int, torch.Tensor]:
    """Where a module call's main input is: its first positional argument, else its first keyword
    argument (Hugging Face layers call attention as ``self_attn(hidden_states=...)``)."""
    if args:
        return 0, args[0]
    if not kwargs:
        raise TypeError("a prepare_input module was called without arguments; it needs its input tensor")
    key = next(iter(kwargs))
    return key, kwargs[key]


def _prepare_input(module: nn.Module, name: str, comm: Comm, sp: bool) -> nn.Module:
    """Make a module's input whole once on entry for its ``colwise_local`` linears (``f``, or an all-gather
    under SP); runs before other pre-hooks so they see the whole input."""
    entry = _GatherFromSequence if sp else _CopyToTP

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        where, x = _first_input(args, kwargs)
        x = entry.apply(x, comm)
        if where == 0:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, where: x}

    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return module


def _vocab(module: nn.Module, name: str, comm: Comm, sp: bool) -> nn.Module:
    """An embedding table or an output head, split by vocabulary."""
    _require(module, (nn.Embedding, nn.Linear), name, "vocab")
    vocab = module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features
    _require_divisible(vocab, comm.mesh.size(AXIS), "vocab size", name, " or pad the vocabulary to a multiple of tp")
    if isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module, comm, sp)
    return ColumnParallelLinear(module, comm, sp)


def _sequence(module: nn.Module, name: str, comm: Comm, sp: bool) -> nn.Module:
    """A replicated module (a LayerNorm) that sees only its sequence slice under SP."""
    if sp:
        for p in module.parameters():
            sum_grad_over_tp(p, comm)
    return module


def _per_head(module: nn.Module, name: str, comm: Comm, sp: bool) -> nn.Module:
    """A replicated module applied to each attention head (Qwen3's q/k RMSNorm): a tp rank holds only its
    heads, so its gradient is its heads' part and is summed over tp, with or without SP."""
    for p in module.parameters():
        sum_grad_over_tp(p, comm)
    return module


class HeadParallel(ShardedModule):
    """A module whose ``weight`` holds one value per query head (GPT-OSS's sinks): each rank keeps its heads'."""

    def __init__(self, module: nn.Module, name: str, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__(comm, sequence_parallel)
        _require_divisible(module.weight.shape[0], comm.mesh.size(AXIS), "heads", name)
        self._adopt("weight", module.weight, ShardSpec(0))

    def forward(self) -> torch.Tensor:
        return self.weight


def _sequence_scatter(module: nn.Module, name: str, comm: Comm, sp: bool) -> nn.Module:
    """A replicated module whose output enters the sequence-parallel region (a position embedding)."""
    if sp:
        module.register_forward_hook(lambda _m, _args, out: _ScatterToSequence.apply(out, comm))
    return module


Style = Callable[[nn.Module, str, Comm, bool], nn.Module]

STYLES: dict[str, Style] = {
    "colwise": _colwise,
    "colwise_qkv": functools.partial(_colwise, chunks=3),
    "colwise_pair": functools.partial(_colwise, chunks=2),
    "colwise_local": _colwise_local,
    "prepare_input": _prepare_input,
    "rowwise": _rowwise,
    "vocab": _vocab,
    "sequence": _sequence,
    "sequence_scatter": _sequence_scatter,
    "per_head": _per_head,
    "heads": HeadParallel,
}
"""Plan styles: ``colwise``/``rowwise`` (Megatron's column/row-parallel linear), ``colwise_qkv`` (a fused
``[q | k | v]`` linear, each rank taking its heads of each third), ``colwise_pair`` (a fused ``[gate | up]``
linear, split half by half), ``vocab`` (an embedding or output head split by vocabulary; a vocab-split
head makes the loss the vocabulary-parallel cross-entropy),
``sequence`` (replicated, inside the sequence-parallel region: gradients summed over tp under SP) and
``sequence_scatter`` (replicated, output split along the sequence under SP), ``per_head`` (replicated,
applied to each head: gradients summed over tp), ``heads`` (one value per head, split like the heads), and a
pair for models
whose attention has separate q/k/v projections (Hugging Face's Llama): ``prepare_input`` on the attention
or MLP module makes its input whole once (``f``; an all-gather along the sequence under SP) and
``colwise_local`` on each linear inside it is a column shard with no communication of its own."""

def match_plan(model: nn.Module, plan: Plan) -> dict[str, str]:
    """Module name -> style for every module the plan names; every pattern must match, each module once."""
    names = [name for name, _ in model.named_modules() if name]
    matched: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"unknown plan style {style!r} for {pattern!r}; choose one of {', '.join(STYLES)}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"plan pattern {pattern!r} matches no module; names look like {', '.join(names[:6])}")
        for n in hits:
            if n in matched:
                raise ValueError(f"{n} is matched by more than one plan pattern; make the patterns disjoint")
            matched[n] = style
    return matched


def apply_tensor_parallel(model: nn.Module, mesh: Mesh, plan: Plan, sequence_parallel: bool = False,
                comm: Comm | None = None) -> Criterion | None:
    """Apply tensor parallelism over ``mesh``'s ``tp`` axis to ``model`` in place as ``plan`` says, sharding its full
    weights; returns the vocabulary-parallel cross-entropy when the head is split by vocabulary, else None."""
    matched = match_plan(model, plan)
    if mesh.size(AXIS) == 1:
        return None
    comm = comm or Comm(mesh)
    vocab_head = False
    shared = _shared_names(model)
    for name, style in matched.items():
        module = model.get_submodule(name)
        replacement = STYLES[style](module, name, comm, sequence_parallel)
        if replacement is not module:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, replacement)
        vocab_head |= style == "vocab" and isinstance(module, nn.Linear)
    for names in shared:
        _retie(model, names)
    return functools.partial(vocab_parallel_cross_entropy, comm=comm) if vocab_head else None


def _shared_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter held under several (an output head tied to the embedding)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _retie(model: nn.Module, names: list[str]) -> None:
    """Make the shards sharding cut of one shared parameter one again: every name takes the first's, which
    the plan must split alike under each name (the vocabulary split of a tied embedding and head)."""
    def spec(name: str) -> ShardSpec | None:
        module, _, pname = name.rpartition(".")
        return getattr(model.get_submodule(module), "specs", {}).get(pname)

    for name in names[1:]:
        if spec(name) != spec(names[0]):
            raise ValueError(f"{names[0]} and {name} are one weight, which the tp plan splits differently; give "
                             f"both modules the same style (vocab for a tied embedding and head)")
        module, _, pname = name.rpartition(".")
        setattr(model.get_submodule(module), pname, model.get_parameter(names[0]))


# --- full (unsharded) weights ------------------------------------------------------------------------

def _sharded_params(model: nn.Module) -> dict[str, tuple[ShardedModule, str]]:
    """State-dict key -> (its tensor-parallel module, the parameter's name there) for every split parameter."""
    return {f"{prefix}.{name}" if prefix else name: (m, name)
            for prefix, m in model.named_modules(remove_duplicate=False) if isinstance(m, ShardedModule)
            for name in m.specs}


def unsharded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict, tp shards gathered into full tensors (a collective over tp)."""
    state = dict(model.state_dict())
    for key, (module, name) in _sharded_params(model).items():
        state[key] = module.unshard(name)
    return state


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load full (unsharded) weights, as a plain model saves them, into a tensor-parallel model: each
    rank keeps its own shard of every split parameter and all of every replicated one."""
    state = model.state_dict()
    if state.keys() != full.keys():
        missing, unexpected = sorted(state.keys() - full.keys()), sorted(full.keys() - state.keys())
        raise KeyError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")
    sharded = _sharded_params(model)
    for key, tensor in state.items():
        src = full[key]
        if key in sharded:
            module, name = sharded[key]
            src = module.shard(name, src)
        tensor.copy_(src)


class Box(NamedTuple):
    """Where a part lies in a full tensor: its start and size per dimension (DCP's chunk). Ours, not DCP's
    class: importing ``torch.distributed.checkpoint`` costs every rank ~0.5 s at start."""

    offsets: torch.Size
    sizes: torch.Size


def spec_boxes(local_shape: torch.Size, spec: ShardSpec, rank: int, size: int) -> tuple[torch.Size, list[Box]]:
    """The full shape of a tensor split by ``spec`` and the boxes rank ``rank``'s part covers, in
    :func:`shard_tensor`'s order: how a checkpoint maps local elements into the full tensor."""
    if spec.chunks > 1 and spec.dim != 0:
        raise ValueError(f"a tensor split in {spec.chunks} chunks along dim {spec.dim} has no row-major box "
                         f"layout; split fused tensors along dim 0")
    full = list(local_shape)
    full[spec.dim] *= size
    part = local_shape[spec.dim] // spec.chunks
    boxes = []
    for c in range(spec.chunks):
        offsets = [0] * len(full)
        offsets[spec.dim] = (c * size + rank) * part
        sizes = list(local_shape)
        sizes[spec.dim] = part
        boxes.append(Box(torch.Size(offsets), torch.Size(sizes)))
    return torch.Size(full), boxes


def shard_boxes(model: nn.Module) -> dict[str, tuple[torch.Size, list[Box]]]:
    """Every parameter's full shape and the boxes this rank holds (:func:`spec_boxes`), under the plain model's
    names: the tp half of a checkpoint's geometry, so any layout reads what another wrote."""
    sharded = _sharded_params(model)
    out = {}
    for name, p in model.named_parameters():
        if name in sharded:
            module, pname = sharded[name]
            out[name] = spec_boxes(p.shape, module.specs[pname], *module._coords())
        else:
            out[name] = (p.shape, [Box(torch.Size([0] * p.dim()), p.shape)])
    return out

