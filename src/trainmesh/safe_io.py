"""Durable and verified file IO: what a checkpoint needs from the file system to survive crashes and damage.

A rename is atomic, but only a rename of data that has reached the disk: a crash after ``rename`` and
before the kernel writes the file back can leave the new name pointing at zeros or a short file
(the "ext4 data=ordered vs. delayed allocation" bug class). So every file is ``fsync``-ed before it is
renamed into place, and the directory holding it is ``fsync``-ed after, which makes the name itself
durable (POSIX leaves directory entries out of a file's ``fsync``).

Reading goes the other way: the bytes are read once, their SHA-256 and length are checked against what
the writer recorded, and only those same bytes are handed on to be parsed, so nothing is parsed that was
not verified (no window between checking a file and reading it again).
"""

from __future__ import annotations

import hashlib
import os
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


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` and ``fsync`` it; a partial file is removed if writing fails
    (a full disk, say), so a failed write leaves nothing that looks finished."""
    try:
        with open(path, "xb") as f:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def replace_durably(path: Path, data: bytes) -> None:
    """Atomically make ``path`` hold ``data``: readers see the old content or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    write_durably(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_verified(path: Path, sha256: str, nbytes: int) -> bytes:
    """The bytes of ``path`` if they are exactly the ``nbytes`` bytes with digest ``sha256``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{path} is missing") from None
    if len(data) != nbytes:
        raise IntegrityError(f"{path} has {len(data)} bytes but was written with {nbytes}: it is truncated or was "
                             f"overwritten (an interrupted copy or a torn write)")
    if sha256_hex(data) != sha256:
        raise IntegrityError(f"{path} does not match the SHA-256 recorded when it was written: the file was "
                             f"changed or corrupted on disk")
    return data
