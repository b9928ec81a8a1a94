"""The collectives trainmesh issues, each counted in bytes sent per rank, per mesh axis and per op.

Counted bytes follow the bandwidth-optimal ring algorithms (Patarasuk & Yuan, 2009; the accounting the
ZeRO paper uses in §7): over a group of n ranks, for a tensor of S bytes each rank sends

* all-reduce:      2 (n-1)/n · S   (reduce-scatter followed by all-gather)
* all-gather:        (n-1)/n · S   (S = the gathered output)
* reduce-scatter:    (n-1)/n · S   (S = the full input)
* broadcast:         (n-1)/n · S   (pipelined ring)
* send:              S

so a run's counted volume can be checked against the theoretical optimum. A collective over an axis of
size 1 is skipped and counts nothing. Scalars reduced only for logging go through :func:`log_all_reduce`
and are not counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainmesh.mesh import Mesh


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the op and its sequence number."""


class _Done:
    """Stands in for the work handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


class Pending:
    """A launched collective; :meth:`wait` re-raises a failure as :class:`CollectiveError` naming the op.

    The ranks of one axis group issue that axis's collectives in the same order, so the per-axis sequence
    number identifies the same call on each of them: a hang report can say which call the waiting ranks
    were stuck in.
    """

    def __init__(self, work, desc: str) -> None:
        self.work, self.desc = work, desc

    def wait(self) -> bool:
        try:
            return self.work.wait()
        except Exception as e:
            raise CollectiveError(f"{self.desc} failed: {e}") from e


class Comm:
    """Collectives over the axes of one :class:`~trainmesh.mesh.Mesh`, with byte accounting."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.bytes: dict[tuple[str, str], float] = defaultdict(float)
        self.seq: dict[str, int] = defaultdict(int)
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def _describe(self, axis: str, op: str) -> str:
        self.seq[axis] += 1
        return f"rank {self.rank}: collective {axis}/{op} #{self.seq[axis]}"

    def _issue(self, axis: str, op: str, nbytes: float, launch, async_op: bool):
        """Count, number and launch one collective; blocks unless ``async_op``."""
        self.bytes[(axis, op)] += nbytes
        pending = Pending(launch(), self._describe(axis, op))
        if async_op:
            return pending
        pending.wait()
        return _DONE

    def _ring(self, axis: str) -> float:
        n = self.mesh.size(axis)
        return (n - 1) / n

    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "all_reduce",
                   async_op: bool = False, reduce_op=dist.ReduceOp.SUM):
        """Sum ``t`` in place over ``axis``; ``op`` names the purpose in the accounting (e.g. grad_norm)."""
        if self.mesh.size(axis) == 1:
            return _DONE
        return self._issue(axis, op, 2 * self._ring(axis) * t.numel() * t.element_size(),
                           lambda: dist.all_reduce(t, op=reduce_op, group=self.mesh.group(axis), async_op=True),
                           async_op)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, axis: str, op: str = "all_gather",
                   async_op: bool = False):
        """Concatenate every rank's ``shard`` along dim 0 into ``out``."""
        if self.mesh.size(axis) == 1:
            out.copy_(shard.reshape(out.shape))
            return _DONE
        return self._issue(axis, op, self._ring(axis) * out.numel() * out.element_size(),
                           lambda: dist.all_gather_single(out, shard, group=self.mesh.group(axis), async_op=True),
                           async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, axis: str, op: str = "reduce_scatter",
                       async_op: bool = False):
        """Sum ``full`` over ``axis`` and keep this rank's 1/n slice (along dim 0) in ``out``."""
        if self.mesh.size(axis) == 1:
            out.copy_(full.reshape(out.shape))
            return _DONE
        return self._issue(axis, op, self._ring(axis) * full.numel() * full.element_size(),
                           lambda: dist.reduce_scatter_single(out, full, group=self.mesh.group(axis), async_op=True),
                           async_op)

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
        """Post point-to-point sends and receives together (``(tensor, global peer rank)`` pairs).

        Posting both directions in one batch lets neighbouring pipeline stages exchange activations and
        gradients without either blocking first; returns the work handles to wait on.
        """
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
        if not ops:
            return []
        self.bytes[(axis, op)] += sum(t.numel() * t.element_size() for t, _ in sends)
        desc = self._describe(axis, op)
        return [Pending(work, desc) for work in dist.batch_isend_irecv(ops)]

    def totals(self) -> dict[str, float]:
        """Bytes sent so far per axis."""
        per_axis: dict[str, float] = defaultdict(float)
        for (axis, _), nbytes in self.bytes.items():
            per_axis[axis] += nbytes
        return dict(per_axis)

    def snapshot(self) -> dict[str, float]:
        """Bytes sent so far per ``axis/op``."""
        return {f"{axis}/{op}": nbytes for (axis, op), nbytes in sorted(self.bytes.items())}


def log_all_reduce(values: torch.Tensor, group: dist.ProcessGroup | None = None,
                   reduce_op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a few logging scalars over ``group`` (the world by default), uncounted."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=reduce_op, group=group)
    return values


def log_all_gather(values: torch.Tensor) -> torch.Tensor:
    """Stack every rank's copy of ``values`` (rows in rank order), uncounted; for per-rank metrics."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values.unsqueeze(0)
    flat = values.reshape(-1)
    out = torch.empty(dist.get_world_size() * flat.numel(), dtype=values.dtype, device=values.device)
    dist.all_gather_single(out, flat)
    return out.view(dist.get_world_size(), *values.shape)
