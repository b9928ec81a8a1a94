"""An advisory lock on a directory, held for a run's life, so two live runs never write the same files.

``fcntl.flock`` on a file in the directory, which the kernel drops when the holder dies however it dies;
the file's record (pid, host, start, :meth:`Lock.note`) decides stale locks, and decides alone where the
file system refuses ``flock``. Details: docs/reliability.md."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainmesh.storage.safe_io import read_regular

LOCK_NAME = ".trainmesh.lock"
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
RECORD_BYTES = 4096
HOLDER = ("pid", "host", "started")
TRIES = 3
RECORD_WAITS = 40  # x 50 ms: how long a loser waits for a new holder's record (the holder writes it right after
# taking the lock, and rewrites it on each note), so the refusal names the holder rather than "holder unknown"


class DirectoryInUse(RuntimeError):
    """Another live run holds the directory; ``holder`` is its record, the message names it and what to do."""

    def __init__(self, message: str, holder: dict) -> None:
        super().__init__(message)
        self.holder = holder


def _parse(data: bytes) -> dict:
    """A lock file's record, or ``{}`` if it says nothing readable (a half-written or hostile file)."""
    try:
        record = json.loads(data or b"{}")
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def read_record(path: Path) -> dict:
    """What lock file ``path`` records ({} if nothing readable), read without holding the lock, without
    following a symbolic link and without reading more than a record can be."""
    try:
        return _parse(read_regular(path, RECORD_BYTES))
    except OSError:
        return {}


def _since(started: object) -> str:
    """When a holder started, as the record says it; "?" where it says nothing a clock can show."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if type(started) in (int, float) else "?"
    except (ValueError, OverflowError, OSError):
        return "?"


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {_since(holder.get('started'))}"


def pid_alive(pid: object) -> bool:
    """Whether process ``pid`` exists on this host (a process of another user counts)."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(holder: dict) -> bool:
    """Whether ``holder`` names a dead process of this host (a record without a host, as older versions
    wrote, is of this host); an unreadable record is a holder still writing it, so not stale."""
    return (type(holder.get("pid")) is int and holder.get("host", socket.gethostname()) == socket.gethostname()
            and not pid_alive(holder["pid"]))


def _held_without_flock(holder: dict) -> bool:
    """Without flock: whether the recorded holder is a live process other than this one, on this host."""
    return (holder.get("host") == socket.gethostname() and holder.get("pid") != os.getpid()
            and pid_alive(holder.get("pid")))


def _flock(fd: int) -> bool:
    """Take the lock without waiting; False if another process holds it (or, where flock is unsupported,
    if the record names a live holder)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in NO_FLOCK:
            raise
        return not _held_without_flock(_parse(os.pread(fd, RECORD_BYTES, 0)))
    return True


def _holder_record(fd: int) -> dict:
    """The record of the lock's other holder: an empty one is a holder between taking the lock and writing its
    record (or rewriting it), so it is read again, up to :data:`RECORD_WAITS` times."""
    for _ in range(RECORD_WAITS):
        record = _parse(os.pread(fd, RECORD_BYTES, 0))
        if record:
            return record
        time.sleep(0.05)
    return record


def _is_at(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _acquire(path: Path, flag: str) -> tuple[int, dict]:
    """An fd of ``path`` holding its lock, and the record its last holder left; a lock taken on a file since
    removed from ``path`` (a dead inode) is retried on the new file."""
    for _ in range(TRIES):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            locked = _flock(fd)
            holder = _parse(os.pread(fd, RECORD_BYTES, 0)) if locked else _holder_record(fd)
        except BaseException:
            os.close(fd)
            raise
        if locked and _is_at(path, fd):
            return fd, holder
        os.close(fd)
        if not locked:
            if not _stale(holder):
                raise DirectoryInUse(f"{flag} {path.parent} is in use by another run ({_describe(holder)}); wait "
                                     f"for it to finish or choose another {flag}", holder)
            path.unlink(missing_ok=True)
    churn = {"pid": "unknown (the lock file keeps changing)"}
    raise DirectoryInUse(f"{flag} {path.parent} is in use: its lock file {path} keeps changing; wait for the "
                         f"other runs to finish or choose another {flag}", churn)


@dataclass
class Lock:
    """A held lock: its descriptor and the record in its file."""

    fd: int
    record: dict

    def note(self, /, **fields: object) -> None:
        """Make the record ``fields`` and this holder's pid, host and start time; where the file is kept,
        the record outlasts the lock."""
        self.record = {**fields, **{key: self.record[key] for key in HOLDER}}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(self.record).encode(), 0)


@contextlib.contextmanager
def hold(directory: Path, flag: str, name: str = LOCK_NAME, keep: bool = False) -> Iterator[Lock]:
    """Hold ``directory``'s lock (file ``name`` in it) for the ``with`` block; :class:`DirectoryInUse`, naming the
    holder and ``flag``, if a live run holds it. The last holder's notes survive until :meth:`Lock.note`;
    ``keep`` leaves the file behind on release, else it is removed while still locked."""
    path = directory / name
    fd, previous = _acquire(path, flag)
    try:
        lock = Lock(fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        lock.note(**previous)
        yield lock
    finally:
        if not keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        os.close(fd)
