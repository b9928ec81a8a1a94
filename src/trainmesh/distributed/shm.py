"""Collectives (:class:`HostCollectives`) and pipeline messages (:class:`Channel`) through shared memory, for the ranks
of a group on one CPU host, where Gloo would copy every byte through sockets (docs/performance.md, "Shared-memory
collectives against Gloo"), as DeepSpeed does. Sums run in rank order, so every rank gets the same bits; the file is
removed once all ranks mapped it, leaving nothing in ``/dev/shm``."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainmesh.distributed.heartbeat import waiting

SLOT_BYTES = 8 * 2**20
"""Bytes of one rank's slot, the largest chunk reduced at once: a segment holds 2 x ranks slots (32 MiB
for 2 ranks), within Docker's default 64 MiB ``/dev/shm`` up to 4 ranks."""
SHM_DIR = Path("/dev/shm")
JOB_ENV = "TRAINMESH_JOB"
"""Set by what starts the ranks (the launcher, the tests' ``run_ranks``): segments are named after the job, so
that it can remove the file of a segment whose first rank was killed before unlinking it
(:func:`remove_segments`)."""


TRANSPORT_ENV = "TRAINMESH_HOST_TRANSPORT"
"""``auto`` (the default) or ``off``; ``--host-transport off`` sets it for every rank (``trainmesh.app.cli``)."""
TRANSPORTS = ("auto", "off")


def enabled() -> bool:
    """Whether one host's ranks may use shared memory (:data:`TRANSPORT_ENV` ``auto``); ``off`` sends everything through
    torch.distributed so a CPU run proves the GPU path. An environment variable, so every rank and ``Comm`` agrees."""
    setting = os.environ.get(TRANSPORT_ENV, "auto")
    if setting not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={setting!r} is not one of {', '.join(TRANSPORTS)}; set it to auto "
                         f"(shared memory between one host's ranks) or off (everything through torch.distributed)")
    return setting == "auto"


def new_job() -> str:
    """A fresh job id for :data:`JOB_ENV`."""
    return uuid.uuid4().hex[:12]


def _segment_name() -> str:
    job = os.environ.get(JOB_ENV)
    return f"trainmesh-{job}-{uuid.uuid4().hex}" if job else f"trainmesh-{uuid.uuid4().hex}"


def remove_segments(job: str) -> None:
    """Remove the segment files job ``job``'s ranks left behind, once all have ended: a rank killed before every rank
    mapped its segment leaves a file holding memory until reboot."""
    for path in SHM_DIR.glob(f"trainmesh-{job}-*"):
        path.unlink(missing_ok=True)


def _host_id() -> str:
    """Names this machine by boot id (containers on one host share it but may not share ``/dev/shm``; mapping then
    fails and the group falls back to Gloo)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}:{boot.read_text().strip() if boot.exists() else ''}"


SEM_BYTES = 64
"""Room for one POSIX ``sem_t`` (32 bytes on 64-bit glibc), padded to a cache line."""
WAIT_S = 300.0
"""How long a message may be waited for on a mesh built without a timeout (``init_distributed``'s default)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's process-shared semaphores (``sem_init``, ``sem_post``, ``sem_timedwait``); None where it
    has none (macOS has no unnamed ones): messages then go through Gloo."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if not all(hasattr(libc, f) for f in ("sem_init", "sem_post", "sem_timedwait")):
        return None
    return libc


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Semaphore:
    """A POSIX semaphore at ``address`` in a shared segment: waits block in the kernel (no spinning on compute cores)
    and order memory written before a post before reads after the wait."""

    def __init__(self, address: int) -> None:
        self.address = ctypes.c_void_p(address)

    def init(self, value: int) -> None:
        if _libc().sem_init(self.address, 1, value) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def post(self) -> None:
        if _libc().sem_post(self.address) != 0:
            raise OSError(ctypes.get_errno(), "sem_post failed")

    def wait(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        when = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        with waiting():
            self._wait_until(when, timeout_s)

    def _wait_until(self, when: _Timespec, timeout_s: float) -> None:
        while _libc().sem_timedwait(self.address, ctypes.byref(when)) != 0:
            error = ctypes.get_errno()
            if error == errno.ETIMEDOUT:
                raise TimeoutError(f"Timed out waiting {timeout_s * 1e3:.0f}ms for a peer in shared memory")
            if error != errno.EINTR:
                raise OSError(error, "sem_timedwait failed")


class HostCollectives:
    """Sums, all-gathers and reduce-scatters over ``group`` through a shared segment (build with :meth:`open`).
    One semaphore per (barrier parity, rank): no rank can be two barriers ahead, so next-barrier posts never
    count towards this one."""

    def __init__(self, group: dist.ProcessGroup, segment: torch.Tensor, timeout_s: float) -> None:
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.arrivals = self._semaphores(segment, self.size)
        self.slots = segment[self.header(self.size):].view(2, self.size, SLOT_BYTES)
        self.timeout_s = timeout_s
        self.calls = self.barriers = 0

    @staticmethod
    def header(size: int) -> int:
        """Bytes before the slots: the barrier semaphores, rounded up to a page."""
        return -(-2 * size * SEM_BYTES // 4096) * 4096

    @staticmethod
    def _semaphores(segment: torch.Tensor, size: int) -> list[list[Semaphore]]:
        """``[parity][rank]``: the semaphore on which ``rank`` waits for the others at barriers of that parity."""
        return [[Semaphore(segment.data_ptr() + (parity * size + r) * SEM_BYTES) for r in range(size)]
                for parity in range(2)]

    @classmethod
    def open(cls, group: dist.ProcessGroup, timeout_s: float) -> HostCollectives | None:
        """Map a segment on every rank of ``group`` (a collective); None on every rank alike across hosts, without
        shared semaphores or where mapping fails. A barrier waits ``timeout_s`` for a peer."""
        if _libc() is None:
            return None
        size = dist.get_world_size(group)

        def prepare(segment: torch.Tensor) -> None:
            for semaphores in cls._semaphores(segment, size):
                for semaphore in semaphores:
                    semaphore.init(0)

        segment = open_segment(group, cls.header(size) + 2 * size * SLOT_BYTES, prepare)
        return cls(group, segment, timeout_s) if segment is not None else None

    def all_reduce(self, t: torch.Tensor, divisor: int = 1) -> None:
        """Sum contiguous ``t`` over the group in place, chunk by chunk, each rank dividing by ``divisor`` the part it
        summed while in cache (the same bits for a power-of-two divisor)."""
        flat = t.view(-1)
        per_chunk = SLOT_BYTES // t.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._chunk(flat[start:start + per_chunk], divisor)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's contiguous ``shard`` into contiguous ``out``, rank r's at slice r, chunk by chunk."""
        flat, whole = shard.view(-1), out.view(self.size, -1)
        per_chunk = SLOT_BYTES // shard.element_size()
        for start in range(0, flat.numel(), per_chunk):
            part = flat[start:start + per_chunk]
            slots = self._next_slots(part.dtype, part.numel())
            slots[self.rank].copy_(part)
            self._barrier()
            whole[:, start:start + part.numel()].copy_(slots)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, divisor: int = 1) -> None:
        """Into contiguous ``out``, the sum over the group of slice ``rank`` of every rank's ``full``, divided by
        ``divisor``, chunk by chunk, summed in rank order."""
        mine, slices = out.view(-1), full.view(self.size, -1)
        per_chunk = SLOT_BYTES // (self.size * full.element_size())
        for start in range(0, mine.numel(), per_chunk):
            part = mine[start:start + per_chunk]
            slots = self._next_slots(part.dtype, self.size * part.numel()).view(self.size, self.size, -1)
            slots[self.rank].copy_(slices[:, start:start + part.numel()])
            self._barrier()
            _sum_in_rank_order(part, slots[:, self.rank], divisor)

    def _next_slots(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Every rank's slot of the next chunk's set, as ``numel`` elements of ``dtype`` each."""
        slots = self.slots[self.calls % 2].view(dtype)[:, :numel]
        self.calls += 1
        return slots

    def _chunk(self, x: torch.Tensor, divisor: int) -> None:
        slots = self._next_slots(x.dtype, x.numel())
        bounds = [x.numel() * k // self.size for k in range(self.size + 1)]
        mine = slice(bounds[self.rank], bounds[self.rank + 1])
        slots[self.rank].copy_(x)
        self._barrier()
        _sum_in_rank_order(x[mine], slots[:, mine], divisor)
        slots[self.rank, mine].copy_(x[mine])
        self._barrier()
        for k in range(self.size):
            if k != self.rank:
                x[bounds[k]:bounds[k + 1]].copy_(slots[k, bounds[k]:bounds[k + 1]])

    def _barrier(self) -> None:
        """Every rank of the group has reached this barrier; what each wrote before it is visible after it."""
        mine = self.arrivals[self.barriers % 2]
        self.barriers += 1
        for r, semaphore in enumerate(mine):
            if r != self.rank:
                semaphore.post()
        for _ in range(self.size - 1):
            mine[self.rank].wait(self.timeout_s)


def _sum_in_rank_order(out: torch.Tensor, parts: torch.Tensor, divisor: int) -> None:
    """``out = (parts[0] + parts[1] + ...) / divisor``, in that order, so every rank gets the same bits."""
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
    if divisor != 1:
        out.div_(divisor)


def open_segment(group: dist.ProcessGroup, nbytes: int,
                 prepare: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
    """``nbytes`` of zeroed memory shared by every rank of ``group`` (a collective), ``prepare``d by its first rank;
    None on every rank alike across hosts or where mapping fails. The file is gone once all have mapped it."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    hosts: list = [None] * size
    dist.all_gather_object(hosts, _host_id(), group=group)
    if len(set(hosts)) > 1:
        return None
    name = [_segment_name() if rank == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    path = SHM_DIR / name[0]
    try:
        segment = _map(path, nbytes) if rank == 0 else None
        if segment is not None and prepare is not None:
            try:
                prepare(segment)
            except OSError:
                segment = None
        created = _agree(rank != 0 or segment is not None, group)  # the file exists before the others open it
        if rank != 0 and created:
            segment = _map(path, nbytes, create=False)
        mapped = _agree(segment is not None, group)
    finally:  # also when a peer failed in between: a file left behind holds its memory until reboot
        if rank == 0:
            path.unlink(missing_ok=True)
    return segment if mapped else None


def _map(path: Path, nbytes: int, create: bool = True) -> torch.Tensor | None:
    """Map ``path``'s ``nbytes``, the creator reserving them first: on a full tmpfs a sparse mapping succeeds and a
    later write kills the rank with SIGBUS, whereas a failed reservation leaves the group on Gloo."""
    if not create and not path.exists():
        return None
    try:
        if create:
            _reserve(path, nbytes)
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):  # open_segment removes the file
        return None


def _reserve(path: Path, nbytes: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def _agree(ok: bool, group: dist.ProcessGroup) -> bool:
    """True on every rank of ``group`` when ``ok`` is true on all of them (a collective)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class Channel:
    """Messages from one rank to another through a ring of ``depth`` shared slots, in order: the sender fills a slot
    and posts ``filled``, the receiver copies out and posts ``free``, both on the calling thread (no thread waits for
    a core)."""

    HEADER = 2 * SEM_BYTES

    def __init__(self, region: torch.Tensor, depth: int, slot_bytes: int, timeout_s: float) -> None:
        self.filled, self.free = self._semaphores(region)
        self.slots = region[self.HEADER:].view(depth, slot_bytes)
        self.depth, self.slot_bytes, self.timeout_s = depth, slot_bytes, timeout_s
        self.sent = self.received = 0
        self.posted: deque[torch.Tensor] = deque()  # receives posted, not yet filled

    @classmethod
    def nbytes(cls, depth: int, slot_bytes: int) -> int:
        return cls.HEADER + depth * slot_bytes

    @classmethod
    def prepare(cls, region: torch.Tensor, depth: int) -> None:
        """Set up the semaphores (once, by the segment's creator, before any peer maps it)."""
        filled, free = cls._semaphores(region)
        filled.init(0)
        free.init(depth)

    @staticmethod
    def _semaphores(region: torch.Tensor) -> tuple[Semaphore, Semaphore]:
        """The region's header: ``filled`` (messages waiting), then ``free`` (slots free)."""
        return Semaphore(region.data_ptr()), Semaphore(region.data_ptr() + SEM_BYTES)

    def send(self, t: torch.Tensor) -> None:
        self.free.wait(self.timeout_s)
        self.slots[self.sent % self.depth, :t.nbytes].copy_(_as_bytes(t))
        self.sent += 1
        self.filled.post()

    def post_recv(self, t: torch.Tensor) -> Callable[[], None]:
        """Claim the next message for ``t``; returns what fills it, which also fills every receive posted
        before it: messages land in the order their receives were posted, whatever order they are waited in."""
        self.posted.append(t)
        last = self.received + len(self.posted)
        return lambda: self._receive_until(last)

    def _receive_until(self, count: int) -> None:
        while self.received < count:
            t = self.posted.popleft()
            self.filled.wait(self.timeout_s)
            _as_bytes(t).copy_(self.slots[self.received % self.depth, :t.nbytes])
            self.received += 1
            self.free.post()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def open_channels(group: dist.ProcessGroup, pairs: list[tuple[int, int]], depth: int, slot_bytes: int,
                  timeout_s: float) -> dict[tuple[int, int], Channel] | None:
    """A :class:`Channel` per directed pair ``(sender, receiver)`` of ``group``'s global ranks, in one segment (a
    collective); None on every rank alike across hosts, without shared semaphores or where mapping fails."""
    if _libc() is None:
        return None
    slot_bytes = -(-slot_bytes // 64) * 64  # each slot starts on a cache line
    each = Channel.nbytes(depth, slot_bytes)

    def prepare(segment: torch.Tensor) -> None:
        for i in range(len(pairs)):
            Channel.prepare(segment[i * each:(i + 1) * each], depth)

    segment = open_segment(group, each * len(pairs), prepare)
    if segment is None:
        return None
    return {pair: Channel(segment[i * each:(i + 1) * each], depth, slot_bytes, timeout_s)
            for i, pair in enumerate(pairs)}
