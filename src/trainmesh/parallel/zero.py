"""ZeRO (Rajbhandari et al., 2020): data parallelism that shards the model state over the ``dp`` axis.

Plain data parallelism keeps all parameters, gradients and AdamW state on every rank. ZeRO-DP partitions
them over the N data-parallel ranks (§5), one more kind per stage:

* stage 1, P_os (§5.1): each rank keeps AdamW state for its 1/N of the elements only. Gradients are
  accumulated in full as in DP, reduce-scattered bucket by bucket as the last micro-batch's backward
  produces them, each rank updates its shard, and the updated parameters are all-gathered.
* stage 2, P_os+g (§5.2): gradients are reduce-scattered during *every* micro-batch's backward into a
  persistent 1/N gradient shard; a bucket's full gradient lives only until its reduce-scatter lands.
  (Holding the full accumulated gradient between micro-batches is exactly what stage 2 removes, so
  :meth:`ZeroEngine.no_sync` does not defer communication here; DeepSpeed does the same.)
* stage 3, P_os+g+p (§5.3): parameters too are kept as 1/N shards. The model is split into units
  (:func:`default_units`). A unit's parameters are all-gathered in one collective before its forward
  and again before its backward, and freed after each; the next unit's gather is issued while the
  current one computes; its gradients are reduce-scattered as soon as backward has produced them all.

Layout. The parameters of a group (a gradient bucket in stages 1-2, a unit in stage 3) lie back to back
in one flat buffer padded to a multiple of N elements, so any parameter size and any N work; rank r owns
elements [rS, (r+1)S) with S = ceil(numel / N). Module parameters become views into that buffer, so
parameter names and objects stay the plain model's; in stage 3 the buffer's storage is resized to zero
between uses (as FSDP's FlatParameter does) and the views stay valid across the re-allocation.

The optimizer is :func:`trainmesh.optim.build_adamw` over *pieces*: the part of each parameter that
falls in this rank's shard, a view into the shard, with its gradient a view into the gradient shard.
AdamW is elementwise, so updating pieces is updating the full parameters.

Mixed precision (Micikevicius et al., 2018; ZeRO §3.1, whose K = 12 counts the fp32 master copy as
optimizer state). Parameters, gathered units and activations are bf16/fp16. Each rank keeps an fp32
*master* copy of its shard only, which the pieces view, so master weights and moments are both 1/N.
Gradients are accumulated and reduce-scattered in ``reduce_dtype`` (fp32 by default: each micro-batch's
low-precision gradient is added into an fp32 buffer, as DataParallel's main-grad path does); the step
reads them in fp32 (a per-step copy if the reduce dtype is narrower), unscales and clips them there,
updates the masters and casts them into the low-precision shard, which is then all-gathered (stages 1-2)
or kept as the shard that the next forward gathers (stage 3). fp16 scales the loss
(:class:`~trainmesh.precision.LossScaler`); the global norm is reduced over every axis, so all ranks see
the same verdict and skip an overflowing step and back the scale off together. In fp32 the shard itself
is the master copy and the gradient shard is the optimizer's gradient: nothing is copied.

Memory and communication per rank follow §5 and §7.2; :func:`model_state_bytes_formula` and
:func:`step_comm_bytes_formula` state them and the tests check measured values against them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from trainmesh.comm import Comm
from trainmesh.parallel.data_parallel import DataParallel, accumulating_locally, axis_buckets, fold_grad_into
from trainmesh.parallel.expert_parallel import reduction_axis, with_expert_units
from trainmesh.layout import Layout, validate
from trainmesh.metrics import optimizer_tensors, storage_bytes
from trainmesh.optim import (TP_SHARDED, OptimizerFactory, ParamPiece, clipped_update, is_tp_sharded,
                             norm_contributions)
from trainmesh.precision import LossScaler, master_dtype

DEFAULT_BUCKET_BYTES = 25 * 2**20

NORM_AXES = ("tp", "pp")  # with the sharding axis: shards are disjoint there, so the squares are summed too


def model_state_bytes_formula(psi: int, n: int, stage: int, mixed_precision: bool = False,
                              grad_bytes: int | None = None) -> float:
    """Parameters + gradients + optimizer state held per rank [ZeRO §3.1, §5.1-5.3, Fig. 1].

    Mixed precision holds (2 + 2 + K)Ψ with K = 12 (fp32 master weights, momentum, variance); stage 1
    divides the K term by N (4Ψ + 12Ψ/N), stage 2 also the gradients (2Ψ + 14Ψ/N), stage 3 also the
    parameters (16Ψ/N). In fp32 the parameters are the master weights, so (4 + 4 + 8)Ψ: 16Ψ,
    8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.

    ``grad_bytes`` is the size of a gradient element, the reduce dtype's; the paper's 2 (bf16/fp16) in
    mixed precision unless given. With the fp32 reduce dtype (trainmesh's default) the gradient term is
    4Ψ: 18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N, 18Ψ/N.
    """
    params, optim = (2, 12) if mixed_precision else (4, 8)
    grads = grad_bytes if grad_bytes is not None else params
    return psi * (params / (n if stage >= 3 else 1) + grads / (n if stage >= 2 else 1)
                  + optim / (n if stage >= 1 else 1))


def step_comm_bytes_formula(psi: int, n: int, stage: int, element_size: int = 4, microbatches: int = 1) -> float:
    """Bytes each rank sends over ``dp`` in one optimizer step, ring volumes [ZeRO §7.2-7.3].

    DP all-reduces the gradients once: 2Ψ(N-1)/N. Stage 1 reduce-scatters them once and all-gathers
    the updated parameters: the same 2Ψ(N-1)/N. Stage 2 reduce-scatters every micro-batch. Stage 3
    gathers the parameters before each forward and each backward and reduce-scatters the gradients,
    3Ψ(N-1)/N per micro-batch: 1.5x DP.
    """
    one_pass = element_size * psi * (n - 1) / n
    return one_pass * {0: 2, 1: 2, 2: microbatches + 1, 3: 3 * microbatches}[stage]


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a group lies in one flat buffer padded to a multiple of ``world`` elements."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    world: int
    rank: int

    @classmethod
    def build(cls, shapes: Sequence[torch.Size], world: int, rank: int) -> "FlatLayout":
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += shape.numel()
        return cls(tuple(shapes), tuple(offsets), total, world, rank)

    @property
    def shard_numel(self) -> int:
        """S = ceil(numel / N): padding of at most N-1 elements lets every size split evenly."""
        return -(-self.numel // self.world)

    @property
    def padded(self) -> int:
        return self.shard_numel * self.world

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full flat buffer (a view)."""
        start = self.rank * self.shard_numel
        return flat[start:start + self.shard_numel]

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i``'s slot in a full flat buffer, shaped like the tensor."""
        offset, shape = self.offsets[i], self.shapes[i]
        return flat[offset:offset + shape.numel()].view(shape)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(flat, i) for i in range(len(self.shapes))]

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(tensor index, start, end)``, in shard coordinates, of each tensor's elements this rank owns."""
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        out = []
        for i, (offset, shape) in enumerate(zip(self.offsets, self.shapes)):
            start, end = max(lo, offset), min(hi, offset + shape.numel())
            if start < end:
                out.append((i, start - lo, end - lo))
        return out


@dataclass
class Group:
    """One flat buffer's worth of parameters: a gradient bucket (stages 1-2) or a unit (stage 3).

    ``flat`` and ``shard`` are in the parameters' dtype, ``grad_flat`` and ``grad_shard`` in the reduce
    dtype; ``master`` is the fp32 shard the optimizer updates (``shard`` itself in fp32 training).
    """

    name: str
    params: list[nn.Parameter]
    layout: FlatLayout
    flat: torch.Tensor
    shard: torch.Tensor
    grad_shard: torch.Tensor
    grad_flat: torch.Tensor | None = None
    master: torch.Tensor | None = None
    pending: int = 0
    reduce_out: torch.Tensor | None = None
    reduce_work: object | None = None
    shard_empty: bool = True
    axis: str = "dp"  # sharded and reduced over it: the engine's axis, or the expert-data-parallel one


def flatten_params(params: list[nn.Parameter], comm: Comm, axis: str) -> tuple[FlatLayout, torch.Tensor]:
    """Move ``params`` into one padded flat buffer holding dp-rank 0's values; they become its views."""
    layout = FlatLayout.build([p.shape for p in params], comm.mesh.size(axis), comm.mesh.rank(axis))
    flat = torch.zeros(layout.padded, dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for view, p in zip(layout.views(flat), params):
            view.copy_(p)
        comm.broadcast(flat, axis, op="init_broadcast")
    for view, p in zip(layout.views(flat), params):
        p.data = view
    return layout, flat


class Exchange:
    """The point-to-point transfers of one direct all-gather or reduce-scatter, waited on as one; ``finish``
    runs once they have all landed (the reduce-scatter's sum)."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None) -> None:
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()
        self.works, self.finish = [], None


def exchanges_directly(comm: Comm, axis: str) -> bool:
    """Whether ``axis``'s all-gathers and reduce-scatters go point to point (:func:`gather_shards`,
    :func:`reduce_scatter_shards`): on Gloo between hosts. Gloo's all-gather receives into a fresh buffer of
    the whole output and copies it out, and its reduce-scatter all-reduces a copy of the whole input (twice
    the bytes of a reduce-scatter: 4.1 ms against 1.6 ms point to point for a 3 MiB unit of ``small`` on two
    ranks here), so each holds a whole unit's extra copy while it runs. NCCL writes in place, and so does
    one host's shared segment (:meth:`~trainmesh.comm.Comm.shares_host`)."""
    return (comm.mesh.size(axis) > 1 and dist.get_backend(comm.mesh.group(axis)) == "gloo"
            and not comm.shares_host(axis))


def _peers(comm: Comm, axis: str) -> list[tuple[int, int]]:
    """``(coordinate on axis, global rank)`` of every other rank of ``axis``."""
    ranks = dist.get_process_group_ranks(comm.mesh.group(axis))
    return [(j, rank) for j, rank in enumerate(ranks) if j != comm.mesh.rank(axis)]


def gather_shards(comm: Comm, flat: torch.Tensor, shard: torch.Tensor, axis: str, op: str):
    """Start gathering every rank's ``shard`` of ``axis`` into ``flat`` (rank j's at slice j); returns the
    handle to wait on. On Gloo each shard goes straight from its owner into its slice of ``flat``: no
    staging copy of the whole buffer (:func:`exchanges_directly`); the bytes sent are the ring's,
    (N-1)·S per rank."""
    if not exchanges_directly(comm, axis):
        return comm.all_gather(flat, shard, axis, op=op, async_op=True)
    size = shard.numel()
    me = comm.mesh.rank(axis)
    flat[me * size:(me + 1) * size].copy_(shard)
    peers = _peers(comm, axis)
    return Exchange(comm.send_recv([(shard, rank) for _, rank in peers],
                                   [(flat[j * size:(j + 1) * size], rank) for j, rank in peers], axis=axis, op=op))


def reduce_scatter_shards(comm: Comm, out: torch.Tensor, full: torch.Tensor, axis: str, op: str, divisor: int = 1):
    """Start summing ``full`` over ``axis``, divided by ``divisor``, into ``out``, this rank's slice; returns
    the handle to wait on. Point to point every rank sends each other rank its slice (divided first) and adds
    the N-1 slices it receives to its own when waited on: (N-1)·S bytes sent, N-1 slices of receive buffer,
    no copy of the whole input."""
    if not exchanges_directly(comm, axis):
        return comm.reduce_scatter(out, full, axis, op=op, async_op=True, divisor=divisor)
    if divisor != 1:
        full.div_(divisor)
    size, me = out.numel(), comm.mesh.rank(axis)
    peers = _peers(comm, axis)
    received = [torch.empty_like(out) for _ in peers]
    works = comm.send_recv([(full[j * size:(j + 1) * size], rank) for j, rank in peers],
                           [(buf, rank) for buf, (_, rank) in zip(received, peers)], axis=axis, op=op)

    def add_received() -> None:
        torch.add(full[me * size:(me + 1) * size], received[0], out=out)
        for buf in received[1:]:
            out.add_(buf)

    return Exchange(works, add_received)


def default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stage-3 wrapping policy: each top-level child is a unit, each block of a ModuleDict/ModuleList
    its own; for :class:`~trainmesh.models.gpt.GPT`: ``embed``, every block, ``ln_f``, ``head``.

    Units are returned in registration order, which the prefetch takes as the forward order (a unit run
    out of that order is simply gathered on the spot).
    """
    units: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            units += [(f"{name}.{sub}", c) for sub, c in child.named_children()]
        else:
            units.append((name, child))
    units = [(name, m) for name, m in units if any(p.requires_grad for p in m.parameters())]
    _check_units_cover(model, units)
    return units


def _check_units_cover(model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    owner: dict[int, str] = {}
    for unit_name, module in units:
        for p in module.parameters():
            if id(p) in owner:
                raise ValueError(f"a parameter is shared by units {owner[id(p)]} and {unit_name}; "
                                 f"put both modules in one unit")
            owner[id(p)] = unit_name
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        raise ValueError(f"parameters {missing} belong to no ZeRO-3 unit; move them into a submodule "
                         f"or pass units that include the module holding them")


def own_params(units: list[tuple[str, nn.Module]]) -> list[list[nn.Parameter]]:
    """Each unit's trainable parameters less those of a unit listed after it inside it (the routed experts
    of a block, :func:`trainmesh.parallel.expert_parallel.with_expert_units`), so every parameter is in one unit."""
    owner = {id(p): k for k, (_, m) in enumerate(units) for p in trainable(m)}
    return [[p for p in trainable(m) if owner[id(p)] == k] for k, (_, m) in enumerate(units)]


def master_shard(shard: torch.Tensor) -> torch.Tensor:
    """The shard the optimizer updates: ``shard`` itself in fp32/fp64, else an fp32 copy of it."""
    return shard if shard.dtype == master_dtype(shard.dtype) else shard.detach().to(master_dtype(shard.dtype))


@dataclass(frozen=True)
class PieceSlot:
    """Where a piece lies: elements [start, end) of ``group``'s shard."""

    group: Group
    start: int
    end: int


def make_pieces(groups: Sequence[Group]) -> tuple[list[nn.Parameter], list[PieceSlot]]:
    """The optimizer's parameters: each parameter's part of this rank's shard, a view into the fp32
    master shard, and where each lies (the step points its gradient at the same slice of the gradient).

    A piece of a matrix is a 1 x k row so :func:`trainmesh.optim.param_groups` decays exactly the
    elements it decays in the full model (not the 1-D ones), and it keeps its parameter's tensor-parallel
    mark so the global norm counts each element once.
    """
    pieces, slots = [], []
    for group in groups:
        for i, start, end in group.layout.pieces():
            p = group.params[i]
            shape = (1, end - start) if p.dim() >= 2 else (end - start,)
            piece = nn.Parameter(group.master[start:end].view(shape))
            setattr(piece, TP_SHARDED, is_tp_sharded(p))
            pieces.append(piece)
            slots.append(PieceSlot(group, start, end))
    return pieces, slots


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class ZeroEngine:
    """What the stages share: the sharded AdamW, gradient reduce-scatter in order, the step, accounting.

    Groups are reduce-scattered in index order on every rank (a group that is ready early waits for the
    ones before it), so the collectives match across ranks, as in :class:`~trainmesh.parallel.data_parallel.DataParallel`.
    Run backward on the loss times :attr:`loss_scale` (1 except in fp16).
    """

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory, groups: list[Group],
                 scaler: LossScaler | None, axis: str) -> None:
        self.module, self.comm, self.axis, self.groups = module, comm, axis, groups
        self.scaler = scaler or LossScaler(enabled=False)
        for group in groups:
            group.master = master_shard(group.shard)
        self.pieces, self._piece_slots = make_pieces(groups)
        self.optimizer = make_optimizer([(f"piece{i}", p) for i, p in enumerate(self.pieces)])
        self._slot = {p: (g, i) for g in groups for i, p in enumerate(g.params)}
        self._next_launch = 0
        self._in_flight: list[Group] = []
        self._reset_pending()
        self.events: list[tuple[str, ...]] = []
        self.peak_state_bytes: int | None = None

    @property
    def dp(self) -> int:
        return self.comm.mesh.size(self.axis)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def _reset_pending(self) -> None:
        for group in self.groups:
            group.pending = len(group.params)
        self._next_launch = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stages 2 and 3 reduce-scatter every micro-batch (see the module docstring): nothing to defer."""
        yield

    @contextlib.contextmanager
    def backward_pass(self, input_only: bool = False) -> Iterator[None]:
        """Mark the autograd calls inside as one micro-batch's backward (see :class:`ZeroStage2`); stage 1
        reduces once per step, on the last micro-batch's gradients, so a pass needs nothing here."""
        yield

    def unshard_for_backward(self, params: Sequence[nn.Parameter]) -> None:
        """Stages 1 and 2 hold the full parameters: nothing to gather (see :class:`ZeroStage3`)."""

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.groups) and self.groups[self._next_launch].pending == 0:
            self._launch(self.groups[self._next_launch])

    def _launch(self, group: Group) -> None:
        """Start the reduce-scatter of ``group``'s full gradient, averaged, into a fresh shard."""
        group.reduce_out = self._reduce_target(group)
        group.reduce_work = reduce_scatter_shards(self.comm, group.reduce_out, group.grad_flat, group.axis,
                                                  "grad_reduce_scatter", divisor=self.dp)
        self.events.append(("reduce_scatter", group.name))
        self._in_flight.append(group)
        self._next_launch += 1
        self._note_peak()

    def _reduce_target(self, group: Group) -> torch.Tensor:
        """Where ``group``'s reduce-scatter writes: a fresh buffer that :meth:`_store` folds in."""
        return torch.empty_like(group.grad_shard)

    def _land(self, group: Group) -> None:
        """Wait for ``group``'s reduce-scatter and fold the result into its gradient shard."""
        group.reduce_work.wait()
        self._store(group, group.reduce_out)
        group.reduce_out = group.reduce_work = None
        self._in_flight.remove(group)

    def _store(self, group: Group, reduced: torch.Tensor) -> None:
        if reduced is not group.grad_shard:
            group.grad_shard.add_(reduced)
        group.shard_empty = False
        group.grad_flat = None

    def _land_all(self) -> None:
        """Launch the groups that got no gradient (zeros, so every rank issues the same collectives), land all."""
        while self._next_launch < len(self.groups):
            group = self.groups[self._next_launch]
            if group.grad_flat is None:
                self._stage_grads(group)
            self._launch(group)
        for group in list(self._in_flight):
            self._land(group)
        self._reset_pending()

    def _stage_grads(self, group: Group) -> None:
        """Copy the gradients ``group``'s parameters hold into a fresh full flat buffer (zeros where a
        parameter got none), then drop them; the reduce-scatters in flight land first, so that one
        group's full gradient is staged at a time."""
        self._land_in_flight()
        flat = group.grad_shard.new_empty(group.layout.padded)
        flat[group.layout.numel:].zero_()
        held = [(view, p.grad) for view, p in zip(group.layout.views(flat), group.params) if p.grad is not None]
        if len(held) < len(group.params):
            flat.zero_()
        if held:
            torch._foreach_copy_([view for view, _ in held], [grad for _, grad in held])
        group.grad_flat = flat
        self._note_peak()
        for p in group.params:
            p.grad = None

    def _land_in_flight(self) -> None:
        """Stages 2 and 3 land every reduce-scatter in flight before staging another group's gradient."""
        for group in list(self._in_flight):
            self._land(group)

    def finish_gradient_sync(self) -> None:
        """Stages 2 and 3 land every reduce-scatter at the end of each backward; nothing is left here."""

    def step(self, lr: float, max_norm: float) -> float:
        """Finish gradient sync, unscale and clip the shards by the whole model's norm, update, re-gather;
        returns the (unscaled) norm before clipping. Shards are disjoint, so the squares are summed over
        ``dp`` as well; every rank then holds the same norm, so a non-finite one (an fp16 overflow or a
        NaN on any rank) skips the update and backs the loss scale off on every rank together."""
        self.finish_gradient_sync()
        grads = self._optimizer_grads()
        norm = clipped_update(self.optimizer, grads, norm_contributions(self.pieces, self.comm.mesh.rank("tp")),
                              self.comm, (self.axis, *NORM_AXES), self.scaler, lr, max_norm)
        if math.isfinite(norm):
            self._copy_masters_to_shards()
            self.after_update()
        self.zero_grad()
        return norm

    def _optimizer_grads(self) -> list[torch.Tensor]:
        """Point each piece's gradient at its slice of the reduced gradient shard, in the masters' dtype: a
        view when the reduce dtype is that dtype, else a copy made for this step (freed by
        :meth:`zero_grad`); returns the gradient shards the optimizer reads."""
        grads = {g.name: g.grad_shard.to(g.master.dtype) for g in self.groups}
        for piece, slot in zip(self.pieces, self._piece_slots):
            piece.grad = grads[slot.group.name][slot.start:slot.end].view(piece.shape)
        self._note_peak()
        return list(grads.values())

    @torch.no_grad()
    def _copy_masters_to_shards(self) -> None:
        """Round the updated fp32 masters into the low-precision parameter shards (nothing to do in fp32)."""
        for group in self.groups:
            if group.master is not group.shard:
                group.shard.copy_(group.master)

    def after_update(self) -> None:
        """All-gather the updated shards into the full parameters (stages 1 and 2, §5.1)."""
        gathers = []
        for group in self.groups:
            source = group.shard.clone()
            gathers.append((source, gather_shards(self.comm, group.flat, source, group.axis, "param_all_gather")))
        for _, work in gathers:
            work.wait()

    def gathered(self) -> contextlib.AbstractContextManager:
        """Stages 1 and 2 hold the full parameters."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        for group in self.groups:
            group.grad_shard.zero_()
            group.shard_empty = True
        self._release_optimizer_grads()
        self.events.clear()

    def _release_optimizer_grads(self) -> None:
        for piece in self.pieces:
            piece.grad = None

    def param_pieces(self) -> list[ParamPiece]:
        """This rank's shard of each parameter, for checkpoints: elements ``[start, end)`` of the parameter
        flattened, as the optimizer's piece (the fp32 master) and as the same slice of the parameter shard.

        After writing into them, call :meth:`after_update` so that stages 1-2 gather the full parameters.
        """
        names = {id(p): n for n, p in self.module.named_parameters()}
        pieces = iter(self.pieces)
        out = []
        for group in self.groups:
            lo = group.layout.rank * group.layout.shard_numel
            for i, start, end in group.layout.pieces():
                base = lo - group.layout.offsets[i]
                piece = next(pieces)
                out.append(ParamPiece(names[id(group.params[i])], start + base, end + base, piece.detach().view(-1),
                                      group.shard[start:end], piece))
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of model state this rank holds now: a freed buffer has an empty storage."""
        params = list(self.module.parameters())
        held = [t for g in self.groups for t in (g.flat, g.shard, g.master, g.grad_shard, g.grad_flat, g.reduce_out)]
        return (params + [p.grad for p in params] + [q.grad for q in self.pieces] + held
                + optimizer_tensors(self.optimizer))

    def _note_peak(self) -> None:
        """Track the most model state held at any point of a step (transient buffers included), while
        :attr:`peak_state_bytes` is a number: set it (to the state held now, say) to start tracking. Each
        sample walks every state tensor, several times per unit, so it is off (``None``) by default."""
        if self.peak_state_bytes is not None:
            self.peak_state_bytes = max(self.peak_state_bytes, storage_bytes(self.state_tensors()))


class ZeroStage1(ZeroEngine):
    """P_os (§5.1): full parameters and gradients, AdamW state for this rank's shard only.

    Gradients accumulate into full flat buckets in the reduce dtype (views where it is the parameters'
    dtype, as in DP; otherwise each gradient is added in and dropped); on the last micro-batch each
    bucket is reduce-scattered as soon as backward completes it, and the averaged shard is copied over
    this rank's slice of the bucket, which the step reads.
    """

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp") -> None:
        buckets = axis_buckets(list(reversed(trainable(module))), bucket_bytes, axis)
        groups = [self._group(i, b, comm, a, reduce_dtype) for i, (a, b) in enumerate(buckets)]
        super().__init__(module, comm, make_optimizer, groups, scaler, axis)
        self.sync = True
        for group in self.groups:
            for p in group.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    @staticmethod
    def _group(index: int, params: list[nn.Parameter], comm: Comm, axis: str, grad_dtype: torch.dtype) -> Group:
        layout, flat = flatten_params(params, comm, axis)
        grad_flat = torch.zeros_like(flat, dtype=grad_dtype)
        return Group(f"bucket{index}", params, layout, flat, layout.shard_of(flat), layout.shard_of(grad_flat),
                     grad_flat=grad_flat, axis=axis)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return accumulating_locally(self)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        group, i = self._slot[p]
        fold_grad_into(group.layout.view(group.grad_flat, i), p)
        if not self.sync:
            return
        self.events.append(("ready", group.name))
        group.pending -= 1
        self._launch_ready()

    def _store(self, group: Group, reduced: torch.Tensor) -> None:
        group.grad_shard.copy_(reduced)

    def finish_gradient_sync(self) -> None:
        self._land_all()

    def zero_grad(self) -> None:
        for group in self.groups:
            group.grad_flat.zero_()
            for p, view in zip(group.params, group.layout.views(group.grad_flat)):
                p.grad = view if view.dtype == p.dtype else None
        self._release_optimizer_grads()
        self.events.clear()


def stage2_bucket_bytes(params: Sequence[nn.Parameter], bucket_bytes: int, world: int,
                        grad_dtype: torch.dtype) -> int:
    """Stage 2's bucket: ``bucket_bytes``, but at most 1/(2N) of the full gradient's bytes.

    Stage 2 holds 1/N of the gradients; its only full gradients are the transient buckets (one alive at a
    time, two where backward fills them out of order). Capped so, they add at most one gradient shard at
    the peak, which then falls below stage 1's, holding every full gradient; a 25 MB bucket on a model
    whose gradients fit in one would hold them all at once, as plain DP does (measured on ``small``, N=2:
    50.71 MiB, above stage 1's 44.37).
    """
    itemsize = torch.empty((), dtype=grad_dtype).element_size()
    grad_bytes = sum(p.numel() for p in params) * itemsize
    return max(1, min(bucket_bytes, grad_bytes // (2 * world)))


class ZeroStage2(ZeroEngine):
    """P_os+g (§5.2): full parameters; gradients reduce-scattered into a 1/N shard during backward.

    A post-accumulate-grad hook counts each gradient in; once a bucket has them all they are copied into
    its transient flat buffer and dropped, and the bucket is reduce-scattered at once, into the
    persistent gradient shard itself on a step's first pass (added to it from a buffer after that), and
    landing it frees the full buffer. The reduce-scatter overlaps backward until the next bucket is
    complete, when it is landed, so one bucket's flat buffer is alive at a time (two only where backward
    fills buckets out of order).

    The end of a backward pass lands every reduce-scatter (launching the buckets that got no gradient,
    so every rank issues the same collectives). That is the end of the autograd call, unless the calls
    run inside :meth:`backward_pass`: the zero-bubble schedule (Qi et al. 2023, §2) splits a
    micro-batch's backward into an input-gradient pass (``input_only``), which produces no parameter
    gradient and so reduces nothing, and a weight-gradient pass of one autograd call per module, whose
    gradients are reduced once when the pass ends rather than once per call.
    """

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp", groups: list[Group] | None = None) -> None:
        if groups is None:
            params = list(reversed(trainable(module)))
            bucket_bytes = stage2_bucket_bytes(params, bucket_bytes, comm.mesh.size(axis), reduce_dtype)
            buckets = axis_buckets(params, bucket_bytes, axis)
            groups = [self._group(f"bucket{i}", b, comm, a, reduce_dtype) for i, (a, b) in enumerate(buckets)]
        super().__init__(module, comm, make_optimizer, groups, scaler, axis)
        self._callback_queued = False
        self._in_pass = self._input_only = False
        for group in self.groups:
            for p in group.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @staticmethod
    def _group(name: str, params: list[nn.Parameter], comm: Comm, axis: str, grad_dtype: torch.dtype) -> Group:
        layout, flat = flatten_params(params, comm, axis)
        return Group(name, params, layout, flat, layout.shard_of(flat),
                     flat.new_zeros(layout.shard_numel, dtype=grad_dtype), axis=axis)

    @contextlib.contextmanager
    def backward_pass(self, input_only: bool = False) -> Iterator[None]:
        """Treat the autograd calls inside as one backward pass, ended once on exit (not on an error,
        after which the ranks' collectives no longer match anyway); ``input_only``: they compute no
        parameter gradient."""
        self._in_pass, self._input_only = True, input_only
        try:
            yield
            self._end_of_backward()
        finally:
            self._in_pass = self._input_only = False

    def _queue_end_of_backward(self) -> None:
        if not (self._callback_queued or self._in_pass):
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        if not self._input_only:
            self._land_all()
        self._callback_queued = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Count ``p``'s gradient in; once its group has them all, stage them (:meth:`_stage_grads`) and
        launch the reduce-scatters now in order. Until then each gradient stays the tensor autograd made:
        a group's full buffer exists only from its last gradient to its reduce-scatter's landing, as FSDP2
        holds its unsharded gradients, rather than from its first gradient on."""
        self._queue_end_of_backward()
        group, _ = self._slot[p]
        self._note_peak()
        group.pending -= 1
        self.events.append(("ready", group.name))
        if group.pending == 0:
            self._on_group_ready(group)
            self._stage_grads(group)
        self._launch_ready()

    def _reduce_target(self, group: Group) -> torch.Tensor:
        """The gradient shard itself while it is still empty (the first pass of a step): the sum lands
        where it is kept, with no buffer and no addition (adding to zero would give the same values)."""
        return group.grad_shard if group.shard_empty else super()._reduce_target(group)

    def _on_group_ready(self, group: Group) -> None:
        """Hook for stage 3, which frees the unit's parameters once its gradients are all in."""

    def _launch(self, group: Group) -> None:
        super()._launch(group)
        for earlier in self._in_flight[:-1]:
            self._land(earlier)


def _grad_tensors(values: object) -> list[torch.Tensor]:
    """The tensors among a module's inputs or output that backward will reach."""
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]


def _when_backward_reaches(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn`` (idempotent: once per tensor) as backward is about to go through the nodes that made
    ``tensors``. A node pre-hook runs after the tensor hooks on those nodes' outputs, so when a unit's
    output is the next unit's input, the next unit is freed (:func:`_when_all_have_grads`) before this
    one is gathered and the one before it prefetched: two units at a time, not three."""
    for t in tensors:
        if t.grad_fn is not None:
            t.grad_fn.register_prehook(lambda grads: fn())
        else:
            t.register_hook(lambda grad: fn())


def _when_all_have_grads(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn`` once the gradient of every one of ``tensors`` has been computed (the graph's one
    backward through them). ``register_multi_grad_hook(mode="all")`` would do, but refuses a leaf
    input of ``torch.autograd.grad``, which a pipeline stage's received input is."""
    left = [len(tensors)]

    def hook(_grad: torch.Tensor) -> None:
        left[0] -= 1
        if left[0] == 0:
            fn()

    for t in tensors:
        t.register_hook(hook)


@dataclass
class Unit:
    """A stage-3 wrapping unit: a module whose parameters are gathered and freed together."""

    name: str
    module: nn.Module
    group: Group
    order: int
    gather_work: object | None = None
    grad_elements: int = 0  # of this backward's gradients in so far

    @property
    def gathered(self) -> bool:
        """Whether the full parameters are allocated (gathered, or a gather is in flight)."""
        return self.group.flat.untyped_storage().nbytes() > 0


class ZeroStage3(ZeroStage2):
    """P_os+g+p (§5.3): parameters sharded too; each unit is gathered for its forward and its backward.

    Forward: a pre-hook gathers the unit (waiting on its prefetch) and issues the next unit's gather;
    a post-hook frees it and hooks its outputs. Backward: the first gradient reaching a unit's outputs
    gathers it again and prefetches the unit before it; once all its parameters' gradients are in, the
    unit is freed and its gradients reduce-scattered (stage 2's machinery, one group per unit). The
    order of collectives depends only on the model, so it is the same on every rank.

    Under the zero-bubble split each unit is gathered three times per micro-batch, so that parameters
    stay sharded between passes (4Ψ(N-1)/N bytes per micro-batch in place of 3Ψ(N-1)/N): for the
    forward; for the input-gradient pass, by the hooks above, which produces no parameter gradient to
    free the unit by, so it is freed once the gradient has reached the unit's inputs; and for the
    weight-gradient pass, whose autograd calls start at module outputs inside the unit, where no output
    hook sees them: the caller gathers their unit with :meth:`unshard_for_backward`.
    """

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp",
                 units: list[tuple[str, nn.Module]] | None = None) -> None:
        units = with_expert_units(units if units is not None else default_units(module), module)
        owned = own_params(units)
        self.units = [Unit(name, m, self._group(name, params, comm, reduction_axis(params[0], axis), reduce_dtype), k)
                      for k, ((name, m), params) in enumerate(zip(units, owned))]
        groups = [u.group for u in reversed(self.units)]
        super().__init__(module, comm, make_optimizer, bucket_bytes, reduce_dtype, scaler, axis, groups)
        self._unit_of = {u.group.name: u for u in self.units}
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u))
            unit.module.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, args, out))
            self._reshard(unit)

    @staticmethod
    def _group(name: str, params: list[nn.Parameter], comm: Comm, axis: str, grad_dtype: torch.dtype) -> Group:
        layout, flat = flatten_params(params, comm, axis)
        return Group(name, params, layout, flat, layout.shard_of(flat).clone(),
                     flat.new_zeros(layout.shard_numel, dtype=grad_dtype), axis=axis)

    def _unshard(self, unit: Unit, op: str) -> None:
        """Allocate the unit's full buffer and start gathering every rank's shard into it."""
        if unit.gathered:
            return
        flat = unit.group.flat
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        unit.gather_work = gather_shards(self.comm, flat, unit.group.shard, unit.group.axis, op)
        self.events.append(("gather", unit.name, op))
        self._note_peak()

    def _wait_gathered(self, unit: Unit) -> None:
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None

    def _reshard(self, unit: Unit) -> None:
        """Free the unit's full parameters (after any gather into them has finished)."""
        self._wait_gathered(unit)
        if unit.gathered:
            self.events.append(("free", unit.name))
        unit.group.flat.untyped_storage().resize_(0)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        k = unit.order + step
        return self.units[k] if 0 <= k < len(self.units) else None

    def _gather_now_and_prefetch(self, unit: Unit, step: int, op: str) -> None:
        self._unshard(unit, op)
        self._wait_gathered(unit)
        following = self._neighbour(unit, step)
        if following is not None:
            self._unshard(following, op)

    def _pre_forward(self, unit: Unit) -> None:
        self._gather_now_and_prefetch(unit, +1, "fwd_param_all_gather")

    def _post_forward(self, unit: Unit, inputs: tuple, output: object) -> None:
        self._reshard(unit)
        self.events.append(("forward", unit.name))
        if not torch.is_grad_enabled():
            return
        outputs, inputs = _grad_tensors(output), _grad_tensors(inputs)
        if outputs:
            _when_backward_reaches(outputs, lambda u=unit: self._pre_backward(u))
        if inputs:
            _when_all_have_grads(inputs, lambda u=unit: self._post_backward_inputs(u))

    def _pre_backward(self, unit: Unit) -> None:
        """Gather the unit for its backward. The unit before it is prefetched once half of this unit's
        gradient has come in (:meth:`_on_grad_ready`), except in an input-only pass, which computes none."""
        self._queue_end_of_backward()
        if self._input_only:
            self._gather_now_and_prefetch(unit, -1, "bwd_param_all_gather")
        else:
            self._unshard(unit, "bwd_param_all_gather")
            self._wait_gathered(unit)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Stage 2's handling, then the backward prefetch once half of the unit's gradient elements are in.

        Backward is the step's memory peak: its first unit starts with every activation saved. Its
        activations are freed as fast as its gradients arrive, so by half of its gradient the unit has
        released far more than the prefetch's buffer (on ``small``, its MLP's 10 MiB against 3 MiB), and the
        gather still overlaps the other half of its backward. Prefetching at the unit's start instead
        holds three units' buffers (this one's parameters and gradient, the next one's parameters) on top
        of every activation."""
        unit = self._unit_of[self._slot[p][0].name]
        unit.grad_elements += p.numel()
        following = self._neighbour(unit, -1)
        if following is not None and 2 * unit.grad_elements >= unit.group.layout.numel:
            self._unshard(following, "bwd_param_all_gather")
        super()._on_grad_ready(p)

    def _post_backward_inputs(self, unit: Unit) -> None:
        """The gradient has gone through the unit to its inputs. An input-only pass needs the unit no more
        (a full backward frees it when its parameters' gradients are in)."""
        if self._input_only:
            self._reshard(unit)

    def unshard_for_backward(self, params: Sequence[nn.Parameter]) -> None:
        """Gather the unit(s) holding ``params`` for an autograd call that computes their gradients from
        inside the unit, prefetching the unit before; each is freed once its gradients are all in, or
        when the backward pass ends."""
        for name in dict.fromkeys(self._slot[p][0].name for p in params):
            self._gather_now_and_prefetch(self._unit_of[name], -1, "bwd_param_all_gather")

    def _on_group_ready(self, group: Group) -> None:
        unit = self._unit_of[group.name]
        unit.grad_elements = 0
        self._reshard(unit)

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        for unit in self.units:
            unit.grad_elements = 0
            self._reshard(unit)

    def after_update(self) -> None:
        """Nothing to gather: the next forward gathers each unit from its updated shard."""

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every unit's full parameters, e.g. to export ``module.state_dict()``; freed on exit.

        A collective: every dp rank must enter it.
        """
        for unit in self.units:
            self._unshard(unit, "state_dict_all_gather")
        try:
            for unit in self.units:
                self._wait_gathered(unit)
            yield
        finally:
            for unit in self.units:
                self._reshard(unit)


def build_engine(module: nn.Module, comm: Comm, stage: int, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp") -> ZeroEngine | DataParallel:
    """The engine of ZeRO ``stage`` over ``axis`` (stage 0: plain data parallelism), with the optimizer
    ``make_optimizer`` builds over its shards (and an fp32 master shard when ``module``'s parameters are
    bf16/fp16). Stage 3 communicates unit by unit (:func:`default_units`), so ``bucket_bytes`` applies to
    stages 0 to 2. The stage is checked by the layout's rules, as every front door checks it."""
    validate(Layout(zero=stage))
    engines = {0: DataParallel, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
    return engines[stage](module, comm, make_optimizer, bucket_bytes, reduce_dtype, scaler, axis)
