"""The collectives trainmesh issues, each counted in bytes sent per rank, per mesh axis and per op.

Counts follow the ring algorithms (Patarasuk & Yuan, 2009; ZeRO §7): all-reduce 2 (n-1)/n · S, the others
(n-1)/n · S, send S. Failures raise :class:`CollectiveError` as the launcher's hang report parses it: ``rank R:
collective AXIS/OP #N (ranks 0,2) failed: ...`` or ``rank R: p2p AXIS/send R->P #N failed: ...``."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from trainmesh.distributed.heartbeat import waiting
from trainmesh.distributed.mesh import Mesh
from trainmesh.distributed.shm import WAIT_S, Channel, HostCollectives, enabled, open_channels


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the op and its sequence number."""


class _Done:
    """Stands in for the work handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


def _raise(error: Exception) -> None:
    raise error


class _Ran:
    """The work handle of an operation run at once: :meth:`wait` raises what it raised."""

    def __init__(self, run: Callable[..., None], *args: object) -> None:
        self.error: Exception | None = None
        try:
            run(*args)
        except Exception as e:  # noqa: BLE001 - re-raised by wait(), named by Pending
            self.error = e

    def wait(self) -> bool:
        if self.error is not None:
            raise self.error
        return True


class _Deferred:
    """The work handle of an operation run by the first :meth:`wait` (a receive from a shared channel)."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run: Callable[[], None] | None = run

    def wait(self) -> bool:
        if self.run is not None:
            run, self.run = self.run, None
            run()
        return True


def format_ranks(ranks: Sequence[int]) -> str:
    """``0-3,8,12-15``: a group's ranks, short enough for an error message even in a large world."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


class Pending:
    """A launched collective or message; :meth:`wait` re-raises a failure as :class:`CollectiveError` naming
    the op, its per-axis sequence number (the same call on every rank) and its group's ranks."""

    def __init__(self, work, desc: str, group: dist.ProcessGroup | None = None, collective: bool = True) -> None:
        self.work, self.desc, self.group, self.collective = work, desc, group, collective

    def wait(self) -> bool:
        try:
            with waiting():
                return self.work.wait()
        except Exception as e:
            members = f" (ranks {format_ranks(_group_ranks(self.group))})" if self.collective else ""
            raise CollectiveError(f"{self.desc}{members} failed: {e}") from e


class Comm:
    """Collectives over the axes of one :class:`~trainmesh.distributed.mesh.Mesh`, with byte accounting."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.bytes: dict[tuple[str, str], float] = defaultdict(float)
        self.seq: dict[str, int] = defaultdict(int)
        self.p2p_seq: dict[tuple[int, int], int] = defaultdict(int)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.hosts: dict[str, HostCollectives | None] = {}
        self.channels: dict[tuple[int, int], Channel] = {}
        self.host_transport = enabled()  # read once: a bad TRAINMESH_HOST_TRANSPORT fails every rank at build

    @property
    def transport(self) -> str:
        """What this comm's traffic went through, for the summary: ``shm+torch.distributed`` once it mapped shared
        memory, else ``torch.distributed``."""
        shared = self.channels or any(host is not None for host in self.hosts.values())
        return "shm+torch.distributed" if shared else "torch.distributed"

    def _describe(self, axis: str, op: str) -> str:
        self.seq[axis] += 1
        return f"rank {self.rank}: collective {axis}/{op} #{self.seq[axis]}"

    def _describe_p2p(self, axis: str, kind: str, src: int, dst: int) -> str:
        """Number a message on its directed pair of ranks: Gloo and NCCL match one pair's sends and receives in
        posting order, so the n-th send src->dst is the n-th receive at dst from src."""
        self.p2p_seq[(src, dst)] += 1
        return f"{axis}/{kind} {src}->{dst} #{self.p2p_seq[(src, dst)]}"

    def _issue(self, axis: str, op: str, nbytes: float, launch, async_op: bool):
        """Count, number and launch one collective; blocks unless ``async_op``."""
        self.bytes[(axis, op)] += nbytes
        desc = self._describe(axis, op)
        try:
            work = launch()
        except Exception as e:  # noqa: BLE001 - failed at once (mapping a segment with a peer gone): named too
            work = _Ran(_raise, e)
        pending = Pending(work, desc, self.mesh.group(axis))
        if async_op:
            return pending
        pending.wait()
        return _DONE

    def _ring(self, axis: str) -> float:
        n = self.mesh.size(axis)
        return (n - 1) / n

    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "all_reduce",
                   async_op: bool = False, reduce_op=dist.ReduceOp.SUM, divisor: int = 1):
        """Sum ``t`` in place over ``axis``, then divide by ``divisor``; ``op`` names it in the accounting. Through
        shared memory on one CPU host, else Gloo (divided first: the same bits for a power-of-two divisor)."""
        if self.mesh.size(axis) == 1:
            if divisor != 1:
                t.div_(divisor)
            return _DONE
        return self._issue(axis, op, 2 * self._ring(axis) * t.numel() * t.element_size(),
                           lambda: self._sum(t, axis, reduce_op, divisor), async_op)

    def _sum(self, t: torch.Tensor, axis: str, reduce_op, divisor: int):
        """Launch :meth:`all_reduce`'s sum: through the axis's shared segment at once where it may, else
        through Gloo."""
        host = self._host_for(axis, t) if reduce_op == dist.ReduceOp.SUM else None
        if host is not None:
            return _Ran(host.all_reduce, t, divisor)
        if divisor != 1:
            t.div_(divisor)
        return dist.all_reduce(t, op=reduce_op, group=self.mesh.group(axis), async_op=True)

    def shares_host(self, axis: str) -> bool:
        """Whether ``axis``'s float collectives go through one host's shared segment (mapped on first use, every
        rank answering alike); not on GPUs, ``--debug-collectives`` or ``TRAINMESH_HOST_TRANSPORT=off``."""
        return (self.mesh.size(axis) > 1 and self.mesh.device.type == "cpu" and self.host_transport
                and dist.get_debug_level() == dist.DebugLevel.OFF and self._host(axis) is not None)

    def _host_for(self, axis: str, *tensors: torch.Tensor) -> HostCollectives | None:
        """The axis's shared segment where ``tensors`` (contiguous, floating point) may go through it."""
        if all(t.is_contiguous() and t.dtype.is_floating_point for t in tensors) and self.shares_host(axis):
            return self._host(axis)
        return None

    def _host(self, axis: str) -> HostCollectives | None:
        """The axis's shared segment, mapped at its first use (None where its ranks span hosts; None too after mapping
        it failed, a peer gone, so the run's later collectives fail through Gloo at once, not one by one)."""
        if axis not in self.hosts:
            self.hosts[axis] = None
            self.hosts[axis] = HostCollectives.open(self.mesh.group(axis), self.mesh.timeout_s or WAIT_S)
        return self.hosts[axis]

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, axis: str, op: str = "all_gather",
                   async_op: bool = False):
        """Concatenate every rank's ``shard`` along dim 0 into ``out`` (through the host's segment where the
        axis's ranks share one, as :meth:`all_reduce`)."""
        if self.mesh.size(axis) == 1:
            out.copy_(shard.reshape(out.shape))
            return _DONE

        def launch():
            host = self._host_for(axis, out, shard)
            if host is not None:
                return _Ran(host.all_gather, out, shard)
            return dist.all_gather_single(out, shard, group=self.mesh.group(axis), async_op=True)

        return self._issue(axis, op, self._ring(axis) * out.numel() * out.element_size(), launch, async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, axis: str, op: str = "reduce_scatter",
                       async_op: bool = False, divisor: int = 1):
        """Sum ``full`` over ``axis``, divided by ``divisor``, keeping this rank's 1/n slice (dim 0) in ``out``:
        through the host's segment where shared, as :meth:`all_reduce`, else Gloo."""
        if self.mesh.size(axis) == 1:
            out.copy_(full.reshape(out.shape))
            if divisor != 1:
                out.div_(divisor)
            return _DONE

        def launch():
            host = self._host_for(axis, out, full)
            if host is not None:
                return _Ran(host.reduce_scatter, out, full, divisor)
            if divisor != 1:
                full.div_(divisor)
            return dist.reduce_scatter_single(out, full, group=self.mesh.group(axis), async_op=True)

        return self._issue(axis, op, self._ring(axis) * full.numel() * full.element_size(), launch, async_op)

    def all_to_all(self, out: torch.Tensor, full: torch.Tensor, axis: str, op: str = "all_to_all",
                   out_splits: list[int] | None = None, in_splits: list[int] | None = None) -> None:
        """Send slice i (dim 0) of ``full`` to coordinate i of ``axis`` (Ulysses's exchange); ``in_splits``/
        ``out_splits`` give uneven rows. Counted: all rows but this rank's own slice."""
        n = self.mesh.size(axis)
        if n == 1:
            out.copy_(full)
            return
        kept = in_splits[self.mesh.rank(axis)] if in_splits is not None else full.shape[0] // n
        row = math.prod(full.shape[1:]) * full.element_size()
        self._issue(axis, op, (full.shape[0] - kept) * row,
                    lambda: dist.all_to_all_single(out, full, out_splits, in_splits, group=self.mesh.group(axis),
                                                   async_op=True),
                    async_op=False)

    def broadcast(self, t: torch.Tensor, axis: str, src: int = 0, op: str = "broadcast") -> None:
        """Copy ``t`` from the rank at coordinate ``src`` of ``axis`` to the others."""
        if self.mesh.size(axis) == 1:
            return
        group = self.mesh.group(axis)
        self._issue(axis, op, self._ring(axis) * t.numel() * t.element_size(),
                    lambda: dist.broadcast(t, src=dist.get_global_rank(group, src), group=group, async_op=True),
                    async_op=False)

    def send_recv(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                  axis: str = "pp", op: str = "p2p") -> list:
        """Post point-to-point sends and receives together (``(tensor, global peer rank)`` pairs) so neighbours
        exchange without blocking; returns work handles, sends first. Pairs with a :meth:`open_channels` channel
        go through shared memory instead."""
        messages = [(dist.isend, t, peer, self.channels.get((self.rank, peer))) for t, peer in sends]
        messages += [(dist.irecv, t, peer, self.channels.get((peer, self.rank))) for t, peer in recvs]
        if not messages:
            return []
        self.bytes[(axis, op)] += sum(t.numel() * t.element_size() for t, _ in sends)
        descs = [self._describe_p2p(axis, "send", self.rank, peer) for _, peer in sends]
        descs += [self._describe_p2p(axis, "recv", peer, self.rank) for _, peer in recvs]
        shared = [ch is not None and t.nbytes <= ch.slot_bytes for _, t, _, ch in messages]
        gloo = [dist.P2POp(f, t, peer) for (f, t, peer, _), s in zip(messages, shared) if not s]
        works = dist.batch_isend_irecv(gloo) if gloo else []
        if len(works) != len(gloo):  # one handle for the whole batch (NCCL, which has no channels)
            return [Pending(works[0], f"rank {self.rank}: p2p {' + '.join(descs)}", collective=False)]
        posted = iter(works)
        handles = [(_Ran(ch.send, t) if f is dist.isend else _Deferred(ch.post_recv(t))) if s else next(posted)
                   for (f, t, _, ch), s in zip(messages, shared)]
        return [Pending(work, f"rank {self.rank}: p2p {desc}", collective=False) for work, desc in zip(handles, descs)]

    def open_channels(self, axis: str, pairs: Sequence[tuple[int, int]], depth: int, slot_bytes: int) -> bool:
        """Shared-memory channels for the directed ``pairs`` of ``axis`` (a collective), ``depth`` messages of up
        to ``slot_bytes`` each; False on every rank where they cannot be made (several hosts, GPU, turned off)."""
        if self.mesh.device.type != "cpu" or self.mesh.size(axis) == 1 or not self.host_transport:
            return False
        opened: list[dict[tuple[int, int], Channel] | None] = []
        group = self.mesh.group(axis)
        Pending(_Ran(lambda: opened.append(open_channels(group, list(pairs), depth, slot_bytes,
                                                          self.mesh.timeout_s or WAIT_S))),
                self._describe(axis, "open_channels"), group).wait()
        self.channels.update(opened[0] or {})
        return opened[0] is not None

    def totals(self) -> dict[str, float]:
        """Bytes sent so far per axis."""
        per_axis: dict[str, float] = defaultdict(float)
        for (axis, _), nbytes in self.bytes.items():
            per_axis[axis] += nbytes
        return dict(per_axis)

    def snapshot(self) -> dict[str, float]:
        """Bytes sent so far per ``axis/op``."""
        return {f"{axis}/{op}": nbytes for (axis, op), nbytes in sorted(self.bytes.items())}


def _uncounted(op: str, group: dist.ProcessGroup | None, work, axis: str = "") -> None:
    """Wait for an unnumbered logging collective; a failure names it and its group (``axis`` when given) like a
    counted one, so a hang report can tell the ranks that were waiting in it from those that never arrived."""
    where = axis or ("world" if group is None else "group")
    Pending(work, f"rank {dist.get_rank()}: collective {where}/{op}", group).wait()


def log_all_reduce(values: torch.Tensor, group: dist.ProcessGroup | None = None,
                   reduce_op=dist.ReduceOp.SUM, op: str = "log_all_reduce", axis: str = "") -> torch.Tensor:
    """Reduce a few scalars over ``group`` (the world by default), uncounted; ``op`` and ``axis`` name it in a
    hang report."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        _uncounted(op, group, dist.all_reduce(values, op=reduce_op, group=group, async_op=True), axis)
    return values


def log_all_gather(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Stack every rank's copy of ``values`` over ``group`` (the world by default; rows in rank order),
    uncounted; for per-rank metrics."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values.unsqueeze(0)
    flat, n = values.reshape(-1), dist.get_world_size(group)
    out = torch.empty(n * flat.numel(), dtype=values.dtype, device=values.device)
    _uncounted("log_all_gather", group, dist.all_gather_single(out, flat, group=group, async_op=True))
    return out.view(n, *values.shape)
