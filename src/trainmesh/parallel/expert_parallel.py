"""Expert parallelism: each MoE layer's routed experts split over ``ep`` ranks, tokens moved by all-to-all.

``ep`` folds inside the token-holding ranks (``dp x cp``, tp too under sp), as Megatron-core and torchtitan do.
:class:`AllToAllDispatch` exchanges counts then copies and reverses it, as Megatron-core's
``MoEAlltoAllTokenDispatcher``; experts reduce over the expert-data-parallel group, divided by the ``dp x cp`` size."""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.distributed.comm import Comm
from trainmesh.models.moe import SequenceSplit, is_expert_param
from trainmesh.parallel.tensor_parallel import Box
from trainmesh.training.optim import COUNTED_ELSEWHERE, SPLIT_OVER_TP

EP_AXIS = "ep"
EXPERT_AXIS = "edp"  # expert data parallel: the ranks that hold the same experts
ETP_AXIS = "etp"  # expert tensor parallel: ranks holding slices of the same experts
EP_SHARD = "_trainmesh_ep_shard"  # on a sliced expert parameter: (ep rank, ep size), split along dim 0
ETP_SHARD = "_trainmesh_etp_shard"  # on an etp-sliced one: (etp rank, etp size, the split dim)
ETP_DIMS = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}  # each expert's w1/w3 [d, f] and b1/b3 [f] split by column,
# w2 [f, d] by row; its b2 [d] whole on every etp rank (:func:`shard_experts`)


class _AllToAll(torch.autograd.Function):
    """An all-to-all of token rows over ``axis`` with the given splits forward (counted as ``op``); backward, the
    reverse all-to-all (splits swapped, counted as ``op_backward``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], dispatcher: AllToAllDispatch,
                op: str, axis: str) -> torch.Tensor:
        ctx.splits, ctx.dispatcher, ctx.op, ctx.axis = (out_splits, in_splits), dispatcher, op, axis
        return dispatcher.exchange(x, out_splits, in_splits, op, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = ctx.dispatcher.exchange(grad.contiguous(), in_splits, out_splits, f"{ctx.op}_backward", ctx.axis)
        return back, None, None, None, None, None


class AllToAllDispatch:
    """The MoE ``Dispatcher`` over ``comm``'s ``ep`` axis, then its ``etp`` axis (``None`` or size 1: nothing moves);
    ``comm`` counts the bytes of ``moe_counts``, ``moe_dispatch``, ``moe_combine`` and their ``_backward`` (the
    planner's all-to-all), and over etp of ``moe_etp_counts``, ``moe_etp_gather`` and ``moe_etp_scatter``."""

    def __init__(self, comm: Comm | None) -> None:
        self.comm = comm
        self.size = comm.mesh.size(EP_AXIS) if comm is not None else 1
        self.etp = comm.mesh.size(ETP_AXIS) if comm is not None else 1

    def exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], op: str,
                 axis: str = EP_AXIS) -> torch.Tensor:
        """Send ``in_splits[r]`` rows of ``x`` to rank ``r`` of ``axis``; receive ``out_splits[r]`` rows from it."""
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.comm.all_to_all(out, x.contiguous(), axis, op, out_splits, in_splits)
        return out

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``x [N, d]`` sorted by global expert, ``counts [E]``: the copies for this rank's experts sorted
        by local expert, their counts ``[E/P]``, and the handle :meth:`combine` needs. Over etp every rank
        sends all its copies to every other (an all-gather of unequal parts), each computing its slice of them."""
        handles = []
        if self.size > 1:
            if counts.numel() % self.size:
                raise ValueError(f"ep={self.size} does not divide the {counts.numel()} experts; choose ep dividing it")
            x, counts, handle = self._move(x, counts, EP_AXIS, ("moe_counts", "moe_dispatch", "moe_combine"))
            handles.append(handle)
        if self.etp > 1:
            x, counts, handle = self._move(x.repeat(self.etp, 1), counts.repeat(self.etp), ETP_AXIS,
                                           ("moe_etp_counts", "moe_etp_gather", "moe_etp_scatter"))
            handles.append(handle)
        return x, counts, handles

    def _move(self, x: torch.Tensor, counts: torch.Tensor, axis: str, ops: tuple[str, str, str]
              ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Rank ``r`` of ``axis`` gets the rows of ``x`` for experts ``[r*L, (r+1)*L)`` of ``counts`` (``[size*L]``),
        sorted by local expert: Megatron-core's ``MoEAlltoAllTokenDispatcher``, counts exchanged first."""
        size = self.comm.mesh.size(axis)
        local = counts.numel() // size
        received = torch.empty_like(counts)
        self.comm.all_to_all(received, counts.contiguous(), axis, ops[0])
        received = received.view(size, local)  # [source rank, local expert]
        in_splits = counts.view(size, local).sum(1).tolist()
        out_splits = received.sum(1).tolist()
        y = _AllToAll.apply(x, out_splits, in_splits, self, ops[1], axis)
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(size),
                                                received.reshape(-1).to(x.device))
        order = torch.sort(expert_of_row, stable=True).indices
        return y.index_select(0, order), received.sum(0), (order, out_splits, in_splits, axis, ops[2])

    def combine(self, y: torch.Tensor, handles: Any) -> torch.Tensor:
        """The inverse of :meth:`dispatch`: ``y`` in local-expert order back to the sender, in its order; over
        etp the senders sum the partial outputs of every etp rank (a reduce-scatter of unequal parts)."""
        for order, out_splits, in_splits, axis, op in reversed(handles or []):
            y = _AllToAll.apply(y.index_select(0, torch.argsort(order)), in_splits, out_splits, self, op, axis)
            if axis == ETP_AXIS:
                y = y.view(self.etp, -1, y.shape[-1]).sum(0)
        return y


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold routed experts (a ``dispatcher`` and stacked ``experts``), by name."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "dispatcher") and hasattr(m, "experts")]


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is a routed expert's parameter (as the MoE layer marks them), a slice of one included."""
    return is_expert_param(p)


def experts_on_any_stage(params: list[nn.Parameter], comm: Comm) -> bool:
    """Whether any pipeline stage holds routed experts (a sum over ``pp``): a dense-only stage must still join
    the experts' norm collectives, contributing zero, or the others wait forever."""
    held = torch.tensor([float(any(is_expert(p) for p in params))], dtype=torch.float64, device=comm.mesh.device)
    comm.all_reduce(held, "pp", op="expert_stages")
    return held.item() > 0


def reduction_axis(p: torch.Tensor, axis: str) -> str:
    """The axis ``p``'s gradient is reduced (and its ZeRO state sharded) over: the expert-data-parallel
    one for a routed expert, else ``axis`` (``dp``, or ``dp_cp`` under context parallelism)."""
    return EXPERT_AXIS if is_expert_param(p) else axis


def with_expert_units(units: list[tuple[str, nn.Module]], model: nn.Module) -> list[tuple[str, nn.Module]]:
    """ZeRO-3's units with each MoE layer's routed experts a unit of their own, right after the unit that
    holds them: they are gathered over another group than the rest of their block."""
    names = {id(m): name for name, m in model.named_modules()}
    out = []
    for name, unit in units:
        out.append((name, unit))
        out += [(f"{names[id(moe)]}.experts", moe.experts) for _, moe in expert_modules(unit)]
    return out


@torch.no_grad()
def shard_experts(moe: nn.Module, comm: Comm, over_tp: bool = False) -> None:
    """Keep this ep rank's ``1/ep`` of ``moe``'s routed experts, of each its etp rank's ``1/etp`` of the hidden
    width (:data:`ETP_DIMS`), and dispatch over ``comm``; parameters keep names and marks and record their place
    (:data:`EP_SHARD`, :data:`ETP_SHARD`) and whether ep folds over tp. The down projection's bias adds to the
    etp ranks' summed partial outputs once: the first etp rank adds it, the others hold a copy for its gradient."""
    mesh = comm.mesh
    for name, p in list(moe.experts.named_parameters(recurse=False)):
        piece, marks = p, {}
        for axis, dim, mark in ((EP_AXIS, 0, EP_SHARD), (ETP_AXIS, ETP_DIMS.get(name), ETP_SHARD)):
            rank, size = mesh.rank(axis), mesh.size(axis)
            if size == 1 or dim is None:
                continue
            if p.shape[dim] % size:
                raise ValueError(f"{axis}={size} does not divide the {p.shape[dim]} rows of dim {dim} of the experts' "
                                 f"{name}; choose {axis} dividing it")
            piece = piece.narrow(dim, rank * (p.shape[dim] // size), p.shape[dim] // size)
            marks[mark] = (rank, size) if axis == EP_AXIS else (rank, size, dim)
        piece = nn.Parameter(piece.clone(), requires_grad=p.requires_grad)
        piece.__dict__.update({**p.__dict__, **marks})
        setattr(piece, SPLIT_OVER_TP, over_tp)
        setattr(piece, COUNTED_ELSEWHERE, mesh.rank(ETP_AXIS) > 0 and name not in ETP_DIMS)
        setattr(moe.experts, name, piece)
    moe.experts.adds_down_bias = mesh.rank(ETP_AXIS) == 0
    moe.dispatcher = AllToAllDispatch(comm)


def ep_place(p: torch.Tensor) -> tuple[int, int]:
    """``(ep rank, ep size)`` of a sliced expert parameter; ``(0, 1)`` for any whole parameter."""
    return getattr(p, EP_SHARD, (0, 1))


def gather_experts(state: dict[str, torch.Tensor], model: nn.Module, groups: dict[str, dist.ProcessGroup | None]
                   ) -> dict[str, torch.Tensor]:
    """``state`` with every sliced expert tensor of ``model`` replaced by all etp ranks' slices, then all ep ranks',
    concatenated along their dims (collectives over ``groups["etp"]`` and ``groups["ep"]``): the plain model's
    full tensor."""
    for name, p in model.named_parameters():
        if name not in state:
            continue
        for axis, (_, size, dim) in ((ETP_AXIS, getattr(p, ETP_SHARD, (0, 1, 0))), (EP_AXIS, (*ep_place(p), 0))):
            if size > 1:
                pieces = [torch.empty_like(state[name]) for _ in range(size)]
                dist.all_gather(pieces, state[name].contiguous(), group=groups[axis])
                state[name] = torch.cat(pieces, dim)
    return state


def apply_expert_parallel(model: nn.Module, comm: Comm, over_tp: bool = False) -> None:
    """Shard every MoE layer of ``model`` over the ep and etp axes of ``comm``'s mesh (nothing to do at 1 and 1);
    ``over_tp``: the expert groups fold over tp (:attr:`trainmesh.distributed.mesh.Mesh.experts_over_tp`)."""
    if comm.mesh.size(EP_AXIS) * comm.mesh.size(ETP_AXIS) == 1:
        return
    for _, moe in expert_modules(model):
        shard_experts(moe, comm, over_tp)


def moe_tp_plan(plan: dict[str, str], model: nn.Module, sequence_parallel: bool,
                experts_over_tp: bool = False) -> dict[str, str]:
    """The family's tp plan fitted to an MoE model: unmatched MLP patterns dropped, MoE layers whole on every tp rank
    with gradients summed over tp under sp (``sequence``), or ``experts_over_tp`` where ep folds there."""
    layers = [name for name, _ in expert_modules(model)]
    if not layers:
        return plan
    names = [name for name, _ in model.named_modules() if name]
    fitted = {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    if sequence_parallel:
        for layer in layers:
            moe = model.get_submodule(layer)
            parts = ["router"] + ([] if experts_over_tp else ["experts"]) + (
                ["shared"] if getattr(moe, "shared", None) is not None else [])
            fitted.update({f"{layer}.{part}": "sequence" for part in parts})
    return fitted


def place_experts(geometry: dict[str, tuple[torch.Size, list[Any]]], model: nn.Module) -> dict[str, tuple[torch.Size, list[Any]]]:
    """A checkpoint's geometry (:func:`trainmesh.parallel.tensor_parallel.shard_boxes`) with every sliced expert
    placed in the plain model's tensor at its etp slice, then at expert ``rank * E_local``, so a checkpoint reads
    back at any ep and etp."""
    out = dict(geometry)
    for name, p in model.named_parameters():
        if name not in out:
            continue
        for rank, size, dim in (getattr(p, ETP_SHARD, (0, 1, 0)), (*ep_place(p), 0)):
            shape, boxes = out[name]
            grown = torch.Size(n * size if d == dim else n for d, n in enumerate(shape))
            out[name] = (grown, [Box(torch.Size(o + rank * shape[dim] * (d == dim) for d, o in enumerate(b.offsets)),
                                     b.sizes) for b in boxes])
    return out


class _SumOverAxis(torch.autograd.Function):
    """All-reduce (sum) over ``axis`` forward; backward, the gradient times ``grad_scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        out = x.clone()
        comm.all_reduce(out, axis, op="moe_sequence_stats")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.grad_scale, None, None, None


def split_sequence_stats(model: nn.Module, comm: Comm, axes: tuple[str, ...]) -> None:
    """Each rank of ``axes`` holds a slice of every sequence (tp under sp, cp): per-sequence balance statistics
    and z-loss are summed over all (:class:`~trainmesh.models.moe.SequenceSplit`), expert counts over tp only.
    Backward keeps each rank's own part, scaled by cp to match the main loss's averaging over cp."""
    scale = {"tp": 1.0, "cp": float(comm.mesh.size("cp"))}

    def summed(t: torch.Tensor, over: tuple[str, ...]) -> torch.Tensor:
        for axis in over:
            t = _SumOverAxis.apply(t, comm, axis, scale[axis])
        return t

    split = SequenceSplit(math.prod(comm.mesh.size(axis) for axis in axes), lambda t: summed(t, axes),
                          lambda t: summed(t, tuple(axis for axis in axes if axis == "tp")))
    for _, moe in expert_modules(model):
        moe.split = split
