"""An advisory lock on a directory, held for a run's life, so two live runs never write the same files.

The lock is ``fcntl.flock`` on ``DIR/.trainmesh.lock``: the kernel drops it when the holding process
dies, however it dies, so a run killed with SIGKILL leaves no lock behind, only a file naming a dead pid,
which the next run takes over. Where the file system refuses ``flock`` (some network mounts), the pid and
host recorded in the file decide instead: a live pid on this host holds the directory, a dead one is stale.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".trainmesh.lock"
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class DirectoryInUse(RuntimeError):
    """Another live run holds the directory; the message names it and what to do."""


def _holder(path: Path) -> dict:
    """What the lock file says about its holder, or ``{}`` if it says nothing readable."""
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {started}"


def pid_alive(pid: object) -> bool:
    """Whether process ``pid`` exists on this host (a process of another user counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held_by_live_pid(holder: dict) -> bool:
    """Without flock: whether the recorded holder is a live process other than this one, on this host."""
    return (holder.get("host") == socket.gethostname() and holder.get("pid") != os.getpid()
            and pid_alive(holder.get("pid")))


def _flock(fd: int) -> bool:
    """Take the lock without waiting; False if another process holds it. Raises where flock is unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_locked(path: Path) -> int | None:
    """An fd of ``path`` holding its flock, or None if a live process holds it.

    A releasing run removes the file while it still holds the lock, so a lock taken on a file that is no
    longer at ``path`` is on a dead inode and is retried on the new file.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _flock(fd):
                os.close(fd)
                return None
        except OSError as e:
            if e.errno not in NO_FLOCK:
                os.close(fd)
                raise
            if _held_by_live_pid(_holder(path)):
                os.close(fd)
                return None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)


@contextlib.contextmanager
def hold(directory: Path, flag: str) -> Iterator[None]:
    """Hold ``directory``'s lock for the ``with`` block; :class:`DirectoryInUse` if a live run holds it.

    ``flag`` (``--out``) names the setting in the message, which says which process holds it.
    """
    path = directory / LOCK_NAME
    fd = _open_locked(path)
    if fd is None:
        raise DirectoryInUse(f"{flag} {directory} is in use by another run ({_describe(_holder(path))}); wait for "
                             f"it to finish or choose another {flag}")
    try:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)
