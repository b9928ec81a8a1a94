"""ZeRO's flat buffers, the optimizer's pieces of them, and the shard exchanges over a sharding axis. A group's
parameters are views into one flat buffer padded to a multiple of N, rank r owning [rS, (r+1)S) (stage 3 frees its
storage between uses, as FSDP's FlatParameter); exchanges are looked up at call time, so a test can substitute them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from trainmesh.distributed.comm import Comm
from trainmesh.training.optim import keep_tp_marks
from trainmesh.training.precision import master_dtype


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
    """One flat buffer's worth of parameters (bucket or unit): ``flat``/``shard`` in the parameters' dtype,
    ``grad_flat``/``grad_shard`` in the reduce dtype, ``master`` the fp32 shard (``shard`` itself in fp32)."""

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


def sharded_group(name: str, params: list[nn.Parameter], comm: Comm, axis: str, grad_dtype: torch.dtype,
                  own_shard: bool = False) -> Group:
    """A group whose gradient is kept only as this rank's shard (stages 2 and 3); ``own_shard`` copies the parameter
    shard so it survives the buffer's storage being freed (stage 3)."""
    layout, flat = flatten_params(params, comm, axis)
    shard = layout.shard_of(flat)
    return Group(name, params, layout, flat, shard.clone() if own_shard else shard,
                 flat.new_zeros(layout.shard_numel, dtype=grad_dtype), axis=axis)


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
    """Whether ``axis``'s all-gathers and reduce-scatters go point to point: on Gloo between hosts, whose
    collectives hold a whole unit's extra copy (NCCL and one host's shared segment work in place)."""
    return (comm.mesh.size(axis) > 1 and dist.get_backend(comm.mesh.group(axis)) == "gloo"
            and not comm.shares_host(axis))


def _peers(comm: Comm, axis: str) -> list[tuple[int, int]]:
    """``(coordinate on axis, global rank)`` of every other rank of ``axis``."""
    ranks = dist.get_process_group_ranks(comm.mesh.group(axis))
    return [(j, rank) for j, rank in enumerate(ranks) if j != comm.mesh.rank(axis)]


def gather_shards(comm: Comm, flat: torch.Tensor, shard: torch.Tensor, axis: str, op: str):
    """Start gathering every rank's ``shard`` of ``axis`` into ``flat`` (rank j's at slice j) and return the handle;
    on Gloo each shard goes straight into its slice (no staging copy), (N-1)·S bytes per rank."""
    if not exchanges_directly(comm, axis):
        return comm.all_gather(flat, shard, axis, op=op, async_op=True)
    size = shard.numel()
    me = comm.mesh.rank(axis)
    flat[me * size:(me + 1) * size].copy_(shard)
    peers = _peers(comm, axis)
    return Exchange(comm.send_recv([(shard, rank) for _, rank in peers],
                                   [(flat[j * size:(j + 1) * size], rank) for j, rank in peers], axis=axis, op=op))


def reduce_scatter_shards(comm: Comm, out: torch.Tensor, full: torch.Tensor, axis: str, op: str, divisor: int = 1):
    """Start summing ``full`` over ``axis`` divided by ``divisor`` into ``out`` (this rank's slice) and return the
    handle; point to point, each rank sends each other its slice and adds what it receives: (N-1)·S bytes, no whole
    copy."""
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
    """The optimizer's parameters, each parameter's part of this rank's fp32 master shard, and where it lies; matrix
    pieces are 1 x k rows (so weight decay picks the same elements) keeping their tp mark."""
    pieces, slots = [], []
    for group in groups:
        for i, start, end in group.layout.pieces():
            p = group.params[i]
            shape = (1, end - start) if p.dim() >= 2 else (end - start,)
            piece = nn.Parameter(group.master[start:end].view(shape))
            keep_tp_marks(piece, p)
            pieces.append(piece)
            slots.append(PieceSlot(group, start, end))
    return pieces, slots

