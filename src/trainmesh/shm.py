"""All-reduce through one shared-memory segment, for the ranks of a group that all run on one CPU host.

Gloo moves every collective through TCP sockets, even between processes of one machine: the kernel copies
each byte into and out of a socket buffer, on cores the ranks also compute on. Through a segment every rank
maps, a rank writes its tensor once, sums its own 1/n of every rank's copy and reads the others' sums.
Medians on 2 ranks of a 2-core host (fp32, 40 calls each, Gloo over loopback vs this):

    size      16 KB   256 KB   1 MB    4 MB    13 MB
    Gloo      0.52    0.69     2.20    4.15    10.5 ms
    segment   0.73    0.74     0.96    1.88     6.2 ms

DeepSpeed reduces among one host's CPU ranks the same way.

The segment holds two sets of one slot per rank, used in turn by successive chunks: a rank that has
finished a chunk may write its next chunk into the other set while a slower rank still reads this one,
so two barriers per chunk suffice (after the writes, after the sums). Sums run in rank order
(``x0 + x1 + ...``), so every rank gets the same bits whatever the timing. The segment's file is removed as
soon as every rank has mapped it, so a rank that dies later leaves nothing behind in ``/dev/shm``.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

SLOT_BYTES = 8 * 2**20
"""Bytes of one rank's slot, the largest chunk reduced at once: a segment holds 2 x ranks slots (32 MiB
for 2 ranks), within Docker's default 64 MiB ``/dev/shm`` up to 4 ranks."""
SHM_DIR = Path("/dev/shm")


def _host_id() -> str:
    """Names this machine: two ranks on one host share a boot id (containers on one host do too, and may
    still not share ``/dev/shm``: mapping the segment then fails on every rank but its creator, and the
    group falls back to Gloo)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}:{boot.read_text().strip() if boot.exists() else ''}"


class HostAllReduce:
    """Sums tensors in place over ``group`` through a shared segment; build it with :meth:`open`."""

    def __init__(self, group: dist.ProcessGroup, segment: torch.Tensor) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.slots = segment.view(2, self.size, SLOT_BYTES)
        self.calls = 0

    @classmethod
    def open(cls, group: dist.ProcessGroup) -> HostAllReduce | None:
        """Map one segment on every rank of ``group`` (a collective over it); None, on every rank alike,
        where the ranks are on different hosts or any of them cannot map the segment."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        hosts: list = [None] * size
        dist.all_gather_object(hosts, _host_id(), group=group)
        if len(set(hosts)) > 1:
            return None
        name = [f"trainmesh-{uuid.uuid4().hex}" if rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
        path = SHM_DIR / name[0]
        segment = cls._map(path, 2 * size * SLOT_BYTES) if rank == 0 else None
        created = _agree(rank != 0 or segment is not None, group)  # the file exists before the others open it
        if rank != 0 and created:
            segment = cls._map(path, 2 * size * SLOT_BYTES, create=False)
        mapped = _agree(segment is not None, group)
        if rank == 0:
            path.unlink(missing_ok=True)
        return cls(group, segment) if mapped else None

    @staticmethod
    def _map(path: Path, nbytes: int, create: bool = True) -> torch.Tensor | None:
        if not create and not path.exists():
            return None
        try:
            return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            return None

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum contiguous ``t`` over the group, in place, chunk by chunk."""
        flat = t.view(-1)
        per_chunk = SLOT_BYTES // t.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._chunk(flat[start:start + per_chunk])

    def _chunk(self, x: torch.Tensor) -> None:
        slots = self.slots[self.calls % 2].view(x.dtype)[:, :x.numel()]
        self.calls += 1
        bounds = [x.numel() * k // self.size for k in range(self.size + 1)]
        mine = slice(bounds[self.rank], bounds[self.rank + 1])
        slots[self.rank].copy_(x)
        dist.barrier(group=self.group)
        torch.add(slots[0, mine], slots[1, mine], out=x[mine])
        for k in range(2, self.size):
            x[mine].add_(slots[k, mine])
        slots[self.rank, mine].copy_(x[mine])
        dist.barrier(group=self.group)
        for k in range(self.size):
            if k != self.rank:
                x[bounds[k]:bounds[k + 1]].copy_(slots[k, bounds[k]:bounds[k + 1]])


def _agree(ok: bool, group: dist.ProcessGroup) -> bool:
    """True on every rank of ``group`` when ``ok`` is true on all of them (a collective)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
