"""Token shards on disk: fixed-dtype binary files plus one small JSON index, memory-mapped for training, so rank memory
does not grow with the corpus. The index is checked on read (:func:`read_index`) and every shard against it before
any rank starts (:func:`verify_shard`), each failure one line naming the file."""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainmesh.data.chat import TRAIN_ON
from trainmesh.data.text import DataError
from trainmesh.data.tokenizer import TokenizerError, TokenizerFile
from trainmesh.storage.safe_io import IntegrityError, inside

INDEX_FILE = "index.json"
FORMAT = "trainmesh-tokens"
VERSION = 1
SPLITS = ("train", "val")
READ_BYTES = 16 << 20
REPREPARE = "re-run trainmesh prepare"
MAX_INDEX_BYTES = 64 << 20
DTYPES = ("uint16", "uint32")
MAX_TOKENS = 1 << 60
_SHA256 = re.compile(r"[0-9a-f]{64}")
LABEL_DTYPE = np.dtype("u1")
_SHARD_NAME = re.compile(r"(train|val)-[0-9]{5,}\.bin")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest fixed dtype holding every id of the vocabulary (little-endian on disk)."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def is_prepared(path: str) -> bool:
    return bool(path) and (Path(path) / INDEX_FILE).is_file()


LABELS_SUFFIX = ".labels"
"""Chat data: beside each ``NAME.bin``, ``NAME.labels`` holds one byte of label bits per token (:mod:`.chat`)."""


@dataclass(frozen=True)
class Shard:
    file: str
    split: str
    tokens: int
    documents: int
    sha256: str
    labels_sha256: str = ""  # chat data only

    @property
    def labels_file(self) -> str:
        return self.file.removesuffix(".bin") + LABELS_SUFFIX


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
    train_on: str = ""
    """Chat data (``prepare --chat``): which tokens are trained, ``assistant`` or ``all``; ``""``: plain text."""

    def split(self, name: str) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.split == name)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id,
                "tokenizer": {"path": self.tokenizer_path, "sha256": self.tokenizer_sha256},
                "documents": {s: sum(x.documents for x in self.split(s)) for s in SPLITS},
                "tokens": {s: sum(x.tokens for x in self.split(s)) for s in SPLITS},
                "shards": [{k: v for k, v in vars(s).items() if v != ""} for s in self.shards],
                **({"chat": {"train_on": self.train_on}} if self.train_on else {})}


class _Fields:
    """Typed access to one JSON object of an index; a wrong or missing value is one line naming the index."""

    def __init__(self, raw: Any, path: Path, what: str) -> None:
        if not isinstance(raw, dict):
            raise _bad(path, f"{what} is {_show(raw)}, not an object")
        self.raw, self.path, self.what = raw, path, what

    def get(self, key: str, kind: type) -> Any:
        value = self.raw.get(key)
        if type(value) is not kind:
            want = {int: "an integer", str: "a string", list: "a list"}[kind]
            raise _bad(self.path, f"{self.what}{key!r} is {_show(value)}, not {want}")
        return value

    def count(self, key: str, low: int = 0, high: int = MAX_TOKENS) -> int:
        value = self.get(key, int)
        if not low <= value <= high:
            raise _bad(self.path, f"{self.what}{key!r} is {value}, outside {low}..{high}")
        return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(path: Path, what: str) -> DataError:
    return DataError(f"{path}: {what}; {REPREPARE}")


def _shard(raw: Any, path: Path, n: int) -> Shard:
    f = _Fields(raw, path, f"shard {n} ")
    name, split = f.get("file", str), f.get("split", str)
    match = _SHARD_NAME.fullmatch(name)
    if not match or match.group(1) != split:
        raise _bad(path, f"shard {n} is {_show(name)} in split {_show(split)}, not a file prepare writes "
                         f"(train-NNNNN.bin or val-NNNNN.bin, in its split)")
    tokens = f.count("tokens")
    sha = f.get("sha256", str)
    if not _SHA256.fullmatch(sha):
        raise _bad(path, f"shard {n} sha256 {_show(sha)} is not 64 hex digits")
    labels = f.get("labels_sha256", str) if "labels_sha256" in raw else ""
    if "labels_sha256" in raw and not _SHA256.fullmatch(labels):
        raise _bad(path, f"shard {n} labels_sha256 {_show(labels)} is not 64 hex digits")
    return Shard(name, split, tokens, f.count("documents", 0, tokens), sha, labels)


def _parse_index(root: Path, raw: Any) -> Index:
    """The index of ``raw`` after checking every field against what ``prepare`` writes."""
    path = root / INDEX_FILE
    top = _Fields(raw, path, "")
    if raw.get("format") != FORMAT or type(raw.get("version")) is not int or raw["version"] != VERSION:
        raise _bad(path, f"not a trainmesh token index (format {FORMAT} version {VERSION})")
    vocab = top.count("vocab_size", 1, 1 << 32)
    dtype = raw.get("dtype")
    if dtype != token_dtype(vocab).name:
        raise _bad(path, f"dtype {_show(dtype)} is not what prepare writes for a vocabulary of {vocab:,} "
                         f"({token_dtype(vocab).name}; it writes only {' or '.join(DTYPES)}: uint16 up to 65,535 "
                         f"tokens, else uint32)")
    eos = top.count("eos_id", 0, vocab - 1)
    tok = _Fields(raw.get("tokenizer"), path, "tokenizer ")
    shard_list = top.get("shards", list)
    shards = tuple(_shard(s, path, n) for n, s in enumerate(shard_list))
    if len({s.file for s in shards}) != len(shards):
        raise _bad(path, "a shard is listed twice")
    for total in ("tokens", "documents"):
        totals = _Fields(raw.get(total), path, f"{total} ")
        for split in SPLITS:
            if totals.count(split) != sum(getattr(s, total) for s in shards if s.split == split):
                raise _bad(path, f"{total} of {split} is {totals.raw[split]}, not the sum over its shards")
    train_on = _Fields(raw["chat"], path, "chat ").get("train_on", str) if "chat" in raw else ""
    if "chat" in raw and train_on not in TRAIN_ON:
        raise _bad(path, f"chat train_on {_show(train_on)} is none of {', '.join(TRAIN_ON)}")
    if any(bool(s.labels_sha256) != bool(train_on) for s in shards):
        raise _bad(path, "labels_sha256 must be listed for every shard of chat data and for no other")
    return Index(root, np.dtype(dtype).newbyteorder("<"), vocab, eos, tok.get("sha256", str), tok.get("path", str),
                 shards, train_on)


@functools.lru_cache(maxsize=8)
def _index_of(root: str, text: bytes) -> Index:
    """The parsed index, cached by its content (so a rewritten index is never served stale)."""
    path = Path(root) / INDEX_FILE
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path} is not a valid token index ({first}); {REPREPARE}") from None
    return _parse_index(Path(root), raw)


def read_index(root: str) -> Index:
    """The index of a prepared directory, checked (see the module docstring)."""
    path = Path(root) / INDEX_FILE
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_INDEX_BYTES + 1)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if len(text) > MAX_INDEX_BYTES:
        raise DataError(f"{path} is over {MAX_INDEX_BYTES >> 20} MiB, not a token index prepare wrote; {REPREPARE}")
    return _index_of(str(Path(root)), text)


def check_shard_file(index: Index, shard: Shard, labels: bool = False) -> Path:
    """A cheap check every rank makes: the shard (or its labels) exists, is not empty and has the indexed length."""
    path = index.root / (shard.labels_file if labels else shard.file)
    dtype = LABEL_DTYPE if labels else index.dtype
    if shard.tokens <= 0:
        raise DataError(f"{path} is an empty shard (0 tokens in {INDEX_FILE}); {REPREPARE}")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"cannot read shard {path}: {e.strerror}; {REPREPARE}") from None
    want = shard.tokens * dtype.itemsize
    if size != want:
        what = "truncated" if size < want else "longer than indexed"
        raise DataError(f"{path} is {what}: {size} bytes, {INDEX_FILE} lists {shard.tokens} {dtype.name} "
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
    if shard.labels_sha256:
        labels = check_shard_file(index, shard, labels=True)
        digest = hashlib.sha256()
        for part in _chunks(labels, LABEL_DTYPE):
            digest.update(part.data)
        if digest.hexdigest() != shard.labels_sha256:
            raise DataError(f"{labels}: SHA-256 does not match {INDEX_FILE} (the labels were altered or damaged); "
                            f"{REPREPARE}")


def index_tokenizer(index: Index, given: str) -> TokenizerFile:
    """The tokenizer prepared data was tokenized with, pinned by content: ``given`` if its SHA-256 matches the index,
    else the copy ``prepare`` kept beside the data (a plain file name; a path elsewhere, missing or mismatched copy
    refused)."""
    want = (f"{index.root} was prepared with ({index.root / index.tokenizer_path}, SHA-256 "
            f"{index.tokenizer_sha256[:12]})")
    if given:
        pinned = TokenizerFile.read(given)
        if pinned.sha256 != index.tokenizer_sha256:
            raise DataError(f"tokenizer {pinned.short()} is not the one {want}; pass that tokenizer or drop "
                            f"--tokenizer")
        return pinned
    try:
        if not index.tokenizer_path.isprintable():
            raise IntegrityError(index.tokenizer_path)
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
    """One split's shards as a single memory-mapped token sequence (``len()`` and slicing). Windows crossing a
    boundary are stitched; pages read are dropped (``MADV_DONTNEED``) so resident memory stays flat."""

    def __init__(self, index: Index, shards: tuple[Shard, ...], labels: bool = False) -> None:
        """``labels``: the shards' label bytes (chat data) instead of their tokens."""
        dtype = LABEL_DTYPE if labels else index.dtype
        self.itemsize = dtype.itemsize
        self.mmaps = [_map(check_shard_file(index, s, labels)) for s in shards]
        self.maps = [np.frombuffer(m, dtype=dtype) for m in self.mmaps]
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
