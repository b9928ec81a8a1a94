"""Token shards on disk: fixed-dtype binary files plus one small JSON index, memory-mapped for training.

``trainmesh prepare`` writes them (:mod:`trainmesh.data.prepare`); ``train --data DIR`` memory-maps them
as numpy arrays, so a rank's memory does not grow with the corpus: only the windows a step reads are
paged in, and released again (:class:`ShardStream`). Documents are held out for validation whole (``val-*.bin``), never cut at a byte offset.

The index records, per shard, its split, token and document counts and SHA-256, and for the corpus the
tokenizer's hash and vocabulary size, the end-of-document id and the dtype (uint16 when the vocabulary
fits, else uint32). Before any rank starts, every shard is checked against it (:func:`verify`), so a
truncated, empty or altered shard, a token id outside the vocabulary or a different tokenizer is one line
naming the file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainmesh.data.text import DataError
from trainmesh.data.tokenizer import TokenizerError, TokenizerFile
from trainmesh.safe_io import IntegrityError, inside

INDEX_FILE = "index.json"
FORMAT = "trainmesh-tokens"
VERSION = 1
SPLITS = ("train", "val")
READ_BYTES = 16 << 20
REPREPARE = "re-run trainmesh prepare"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest fixed dtype holding every id of the vocabulary (little-endian on disk)."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def is_prepared(path: str) -> bool:
    return bool(path) and (Path(path) / INDEX_FILE).is_file()


@dataclass(frozen=True)
class Shard:
    file: str
    split: str
    tokens: int
    documents: int
    sha256: str


@dataclass(frozen=True)
class Index:
    """What ``index.json`` says about a prepared corpus."""

    root: Path
    dtype: np.dtype
    vocab_size: int
    eos_id: int
    tokenizer_sha256: str
    tokenizer_path: str
    shards: tuple[Shard, ...]

    def split(self, name: str) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.split == name)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id,
                "tokenizer": {"path": self.tokenizer_path, "sha256": self.tokenizer_sha256},
                "documents": {s: sum(x.documents for x in self.split(s)) for s in SPLITS},
                "tokens": {s: sum(x.tokens for x in self.split(s)) for s in SPLITS},
                "shards": [vars(s) for s in self.shards]}


def _parse_index(root: Path, raw: dict[str, Any]) -> Index:
    if raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise DataError(f"{root / INDEX_FILE} is not a trainmesh token index (format {FORMAT} version {VERSION}); "
                        f"{REPREPARE}")
    shards = tuple(Shard(s["file"], s["split"], int(s["tokens"]), int(s["documents"]), s["sha256"])
                   for s in raw["shards"])
    for s in shards:
        if Path(s.file).name != s.file or s.split not in SPLITS:
            raise DataError(f"{root / INDEX_FILE}: shard entry {s.file!r} is not a file of this directory "
                            f"in split train or val; {REPREPARE}")
    return Index(root, np.dtype(raw["dtype"]).newbyteorder("<"), int(raw["vocab_size"]), int(raw["eos_id"]),
                 raw["tokenizer"]["sha256"], raw["tokenizer"]["path"], shards)


@functools.lru_cache(maxsize=8)
def _read_index_cached(root: str, mtime_ns: int) -> Index:
    path = Path(root) / INDEX_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return _parse_index(Path(root), raw)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path} is not a valid token index ({type(e).__name__}: {e}); {REPREPARE}") from None


def read_index(root: str) -> Index:
    """The index of a prepared directory (read once per version of the file)."""
    path = Path(root) / INDEX_FILE
    try:
        return _read_index_cached(str(Path(root)), path.stat().st_mtime_ns)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None


def check_shard_file(index: Index, shard: Shard) -> Path:
    """A cheap check every rank makes: the shard exists, is not empty and has the indexed length."""
    path = index.root / shard.file
    if shard.tokens <= 0:
        raise DataError(f"{path} is an empty shard (0 tokens in {INDEX_FILE}); {REPREPARE}")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"cannot read shard {path}: {e.strerror}; {REPREPARE}") from None
    want = shard.tokens * index.dtype.itemsize
    if size != want:
        what = "truncated" if size < want else "longer than indexed"
        raise DataError(f"{path} is {what}: {size} bytes, {INDEX_FILE} lists {shard.tokens} {index.dtype.name} "
                        f"tokens ({want} bytes); {REPREPARE}")
    return path


def _chunks(path: Path, dtype: np.dtype) -> Iterator[np.ndarray]:
    """The file in fixed-size reads, so checking a corpus never maps (or holds) more than one read of it."""
    with open(path, "rb") as f:
        while raw := f.read(READ_BYTES - READ_BYTES % dtype.itemsize):
            yield np.frombuffer(raw, dtype=dtype)


def verify_shard(index: Index, shard: Shard) -> None:
    """The full check, made once before training: length, SHA-256 and every id below the vocabulary."""
    path = check_shard_file(index, shard)
    digest, seen = hashlib.sha256(), 0
    for ids in _chunks(path, index.dtype):
        digest.update(ids.data)
        top = int(ids.max())
        if top >= index.vocab_size:
            at = seen + int(np.argmax(ids >= index.vocab_size))
            raise DataError(f"{path}: token id {top} at position {at} is outside the vocabulary of "
                            f"{index.vocab_size} in {INDEX_FILE}; {REPREPARE} with the right tokenizer")
        seen += len(ids)
    if digest.hexdigest() != shard.sha256:
        raise DataError(f"{path}: SHA-256 does not match {INDEX_FILE} (the shard was altered or damaged); "
                        f"{REPREPARE}")


def index_tokenizer(index: Index, given: str) -> TokenizerFile:
    """The tokenizer prepared data was tokenized with, pinned by content: ``given`` (``--tokenizer``) if its
    SHA-256 is the one the index records, else the copy ``prepare`` keeps in the data directory. The index
    names that copy by a plain file name in its directory: a path leading anywhere else is refused unread,
    and so is a copy that is missing or whose SHA-256 differs, each in one line naming both hashes."""
    want = (f"{index.root} was prepared with ({index.root / index.tokenizer_path}, SHA-256 "
            f"{index.tokenizer_sha256[:12]})")
    if given:
        pinned = TokenizerFile.read(given)
        if pinned.sha256 != index.tokenizer_sha256:
            raise DataError(f"tokenizer {pinned.short()} is not the one {want}; pass that tokenizer or drop "
                            f"--tokenizer")
        return pinned
    try:
        path = inside(index.root, index.tokenizer_path)
    except IntegrityError:
        raise DataError(f"{index.root / INDEX_FILE} names tokenizer {index.tokenizer_path!r}, not a file of "
                        f"{index.root}; it is not read: pass the tokenizer {index.root} was prepared with "
                        f"(SHA-256 {index.tokenizer_sha256[:12]}) as --tokenizer, or prepare again") from None
    try:
        pinned = TokenizerFile.read(path, follow=False)
    except TokenizerError as e:
        raise DataError(f"{e}; {want}: pass it as --tokenizer, or prepare again") from None
    if pinned.sha256 != index.tokenizer_sha256:
        raise DataError(f"tokenizer {pinned.short()} has changed since {want}; pass that tokenizer as "
                        f"--tokenizer, or prepare again")
    return pinned


def _map(path: Path) -> mmap.mmap:
    """A read-only mapping of ``path`` advised for random access: no readahead around each window."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


class ShardStream:
    """One split's shards as a single memory-mapped token sequence: ``len()`` and slicing, as a tensor has.

    A slice that crosses a shard boundary is stitched from both (documents run on across shards as they
    run on within one, separated by the end-of-document token). A window is copied out and its pages are
    then dropped from this process's mapping (``MADV_DONTNEED``; they stay in the kernel's page cache), so
    a rank's resident memory stays flat however long it samples, rather than growing towards the corpus."""

    def __init__(self, index: Index, shards: tuple[Shard, ...]) -> None:
        self.itemsize = index.dtype.itemsize
        self.mmaps = [_map(check_shard_file(index, s)) for s in shards]
        self.maps = [np.frombuffer(m, dtype=index.dtype) for m in self.mmaps]
        self.starts = np.cumsum([0] + [s.tokens for s in shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _release(self, i: int, start: int, stop: int) -> None:
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = start * self.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
        self.mmaps[i].madvise(mmap.MADV_DONTNEED, first, stop * self.itemsize - first)

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(len(self))
        parts, i = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            local = int(start - self.starts[i])
            take = min(stop - start, len(self.maps[i]) - local)
            parts.append(self.maps[i][local:local + take].astype(np.int64))
            self._release(i, local, local + take)
            start, i = start + take, i + 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
