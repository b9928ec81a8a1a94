"""Durable and verified file IO: what a checkpoint needs from the file system to survive crashes and damage. Files
are ``fsync``-ed before their atomic rename and the directory after; reads verify SHA-256 and length on the bytes
parsed, and refuse anything but a regular file reached without a symbolic link, checking its size first."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path


class IntegrityError(OSError):
    """A file is missing, short, or does not hold the bytes that were written; the message names it."""


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (names created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write ``data`` to a new file ``path`` (created with permissions ``mode``, less the umask; an entry
    already there, a symbolic link included, is refused) and ``fsync`` it; a partial file is removed if
    writing fails (a full disk, say), so a failed write leaves nothing that looks finished."""
    try:
        with open(path, "xb", opener=lambda name, flags: os.open(name, flags, mode)) as f:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def replace_durably(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Atomically make ``path`` hold ``data``: readers see the old content or the new, never a mix (a link
    at ``path`` is replaced, never followed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    write_durably(tmp, data, mode)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def inside(directory: Path, name: str) -> Path:
    """``directory / name`` if ``name`` is a plain file name that stays inside ``directory`` once resolved."""
    path = directory / name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise IntegrityError(f"{directory}: {name!r} is not a plain file name")
    if path.resolve().parent != directory.resolve():
        raise IntegrityError(f"{path} leads outside {directory} (a symbolic link); a checkpoint holds only "
                             f"regular files")
    return path


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, as a refusal names it."""
    return "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"


def _open_regular(path: Path) -> tuple[int, int]:
    """A read-only descriptor of regular file ``path`` and its size; never follows a symbolic link at
    ``path`` and never blocks (a FIFO is opened non-blocking, then refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise IntegrityError(f"{path} is missing") from None
    except OSError as e:
        what = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        raise IntegrityError(f"{path} {what}; a checkpoint holds only regular files") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise IntegrityError(f"{path} is {_kind(mode)}, not a regular file")
    return fd, os.fstat(fd).st_size


def _size_mismatch(path: Path, size: int, nbytes: int) -> IntegrityError:
    return IntegrityError(f"{path} has {size} bytes but was written with {nbytes}: it is truncated or was "
                          f"overwritten (an interrupted copy or a torn write)")


def _read_fd(fd: int, size: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read(size)


def check_regular(path: Path, nbytes: int) -> None:
    """Raise :class:`IntegrityError` unless ``path`` is a regular file of ``nbytes`` bytes (nothing is read)."""
    fd, size = _open_regular(path)
    os.close(fd)
    if size != nbytes:
        raise _size_mismatch(path, size, nbytes)


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of regular file ``path``, refused if it is larger than ``limit``."""
    return read_regular_with_mode(path, limit)[0]


def read_regular_with_mode(path: Path, limit: int) -> tuple[bytes, int]:
    """The bytes of regular file ``path`` (never through a symbolic link, refused past ``limit`` bytes) and
    its permission bits, so that a copy of it is never made readable by more users than the original."""
    fd, size = _open_regular(path)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if size > limit:
        os.close(fd)
        raise IntegrityError(f"{path} has {size} bytes, more than the {limit} such a file can have")
    return _read_fd(fd, size), mode


def read_verified(path: Path, sha256: str, nbytes: int) -> bytes:
    """The bytes of ``path`` if they are exactly the ``nbytes`` bytes with digest ``sha256``; the size is
    checked before anything is read."""
    fd, size = _open_regular(path)
    if size != nbytes:
        os.close(fd)
        raise _size_mismatch(path, size, nbytes)
    data = _read_fd(fd, nbytes)
    if len(data) != nbytes:
        raise _size_mismatch(path, len(data), nbytes)
    if sha256_hex(data) != sha256:
        raise IntegrityError(f"{path} does not match the SHA-256 recorded when it was written: the file was "
                             f"changed or corrupted on disk")
    return data


# --- a run folder's own files: written without following a symbolic link planted at their names ----------

def refuse_link(path: Path, what: str) -> None:
    """Raise :class:`IntegrityError` naming ``path`` if it is a symbolic link, which would make a run write its own
    files wherever the link leads."""
    if path.is_symlink():
        raise IntegrityError(f"{path} is a symbolic link (to {os.readlink(path)}); {what} writes its own file "
                             f"there and never follows a link: remove the link")


def open_own_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of regular file ``path`` opened with ``flags`` (``O_WRONLY | O_CREAT``...) without
    following a symbolic link at ``path`` and without blocking on a FIFO; anything but a regular file
    there is :class:`IntegrityError` naming it, and nothing is written to it."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise IntegrityError(f"{path} is a symbolic link; it is never followed: remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{path} is not a regular file; remove it")
    return fd


def remove_entry(path: Path) -> None:
    """Remove ``path`` whatever it is, never following a symbolic link: a link or a file is unlinked (what
    it points to is untouched), a directory removed with its contents; a missing one is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink()


# --- files a user names: regular files only, read to a bound ----------------------------------------------

class UnreadableFile(OSError):
    """A file a user named that cannot be read as one: missing, not a regular file, or larger than its
    bound; ``str()`` is one line, the path and what is wrong."""


def read_user_file(path: str | Path, limit: int) -> bytes:
    """The bytes of a file a user named (``--config``, ``metrics.jsonl``, ``config.json``), at most ``limit``.
    Links are followed, but it must be a regular file (FIFOs opened non-blocking and refused); the bound is
    checked before reading and by reading one byte past it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UnreadableFile(f"{path} does not exist") from None
    except PermissionError:
        raise UnreadableFile(f"{path} cannot be read (permission denied)") from None
    except OSError as e:
        raise UnreadableFile(f"{path} cannot be opened ({e.strerror})") from None
    mode, size = os.fstat(fd).st_mode, os.fstat(fd).st_size
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnreadableFile(f"{path} is {_kind(mode)}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise UnreadableFile(f"{path} is larger than {limit:,} bytes, the most such a file may have")
        return data
