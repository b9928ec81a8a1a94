"""``trainmesh prepare``: tokenize a corpus once, in parallel worker processes, into token shards.

Output is in input order whatever the worker count, memory bounded by ``BATCH_BYTES + 2·PIECE_BYTES``; shards are
published atomically (``index.json`` last), removed on failure, and a lock refuses a second run into ``--out``.
Document k is held out when ``ceil((k+1)·f) > ceil(k·f)`` for ``--val-fraction f``. With ``--chat`` each
JSONL line is a conversation, rendered and labelled in this process (:mod:`.chat`), with a label shard beside each
token shard."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from trainmesh.data import chat
from trainmesh.data.shards import INDEX_FILE, LABEL_DTYPE, LABELS_SUFFIX, Index, Shard, token_dtype
from trainmesh.storage.safe_io import replace_durably
from trainmesh.data.sources import input_files, input_size, pieces
from trainmesh.data.text import DataError
from trainmesh.data.workers import Workers, WorkerDied
from trainmesh.tracking import runlock

if TYPE_CHECKING:
    from trainmesh.data.tokenizer import Tokenizer, TokenizerFile

BATCH_BYTES = 1 << 20
DEFAULT_SHARD_TOKENS = 1 << 27
PLAIN_EVERY_S = 10.0


@dataclass(frozen=True)
class PrepareOptions:
    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    workers: int = max(1, os.cpu_count() or 1)
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    val_fraction: float = 0.05
    chat: bool = False
    """JSONL conversations rendered with the chat template of the tokenizer folder ``tokenizer`` (:mod:`.chat`)."""
    train_on: str = "assistant"


# --- the parent ---------------------------------------------------------------------------------------

class ProgressMeter:
    """Input MB/s and ETA: a bar (tqdm) on a terminal, a plain line every ``PLAIN_EVERY_S`` otherwise."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.start = self.last = time.perf_counter()
        self.bar = None
        if stream.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=stream)
            except ImportError:
                pass

    def add(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last >= PLAIN_EVERY_S:
            self.last = now
            rate = self.done / (now - self.start)
            eta = (self.total - self.done) / rate if rate else float("inf")
            self.stream.write(f"prepare: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB, "
                              f"{rate / 1e6:.2f} MB/s, ETA {eta:.0f} s\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class SplitWriter:
    """Appends one split's tokens to shard files of about ``shard_tokens`` each, cut at document ends."""

    root: Path
    split: str
    dtype: np.dtype
    shard_tokens: int
    suffix: str = ".bin"
    shards: list[Shard] = field(default_factory=list)
    _file: Any = None
    _digest: Any = None
    _tokens: int = 0
    _docs: int = 0

    def write(self, ids: np.ndarray, ends_document: bool) -> None:
        if self._file is None:
            name = f"{self.split}-{len(self.shards):05d}{self.suffix}"
            self._file, self._digest, self._tokens, self._docs = open(self.root / name, "wb"), hashlib.sha256(), 0, 0
        data = ids.astype(self.dtype, copy=False).tobytes()
        self._file.write(data)
        self._digest.update(data)
        self._tokens += len(ids)
        self._docs += ends_document
        if ends_document and self._tokens >= self.shard_tokens:
            self.close()

    def discard(self) -> None:
        """Remove every file this writer made (after a failure)."""
        names = [s.file for s in self.shards]
        if self._file is not None:
            self._file.close()
            names.append(Path(self._file.name).name)
            self._file = None
        for name in names:
            (self.root / name).unlink(missing_ok=True)
        self.shards = []

    def close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self.shards.append(Shard(Path(self._file.name).name, self.split, self._tokens, self._docs,
                                 self._digest.hexdigest()))
        self._file = None


def _batches(files: list[Path]) -> Iterator[tuple[list[tuple[str, bool]], int, str]]:
    """Pieces grouped into batches of about ``BATCH_BYTES`` of text, with the input bytes they consumed and
    the inputs they came from (named if a worker dies on the batch)."""
    batch, text_bytes, input_bytes, names = [], 0, 0, []
    for f in files:
        for p in pieces(f):
            if not names or names[-1] != str(f):
                names.append(str(f))
            batch.append((p.text, p.ends_document))
            text_bytes += len(p.text)
            input_bytes += p.input_bytes
            if text_bytes >= BATCH_BYTES:
                yield batch, input_bytes, _label(names)
                batch, text_bytes, input_bytes, names = [], 0, 0, []
    if batch:
        yield batch, input_bytes, _label(names)


def _label(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} (and {len(names) - 1} more input(s))"


def _held_out(doc: int, fraction: float) -> bool:
    return math.ceil((doc + 1) * fraction) > math.ceil(doc * fraction)


def _make_out_dir(out: Path) -> bool:
    """Create ``out`` unless it is a directory already; whether this run created it."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not an empty directory; choose a new directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create --out {out}: {e.strerror}") from None
    return created


def _check_empty(out: Path) -> None:
    """Refuse a directory holding anything but this run's lock; name the way out for a run that was cut off."""
    held = [p.name for p in out.iterdir() if p.name != runlock.LOCK_NAME]
    if INDEX_FILE in held:
        raise DataError(f"--out {out} holds a prepared data set already; choose a new directory")
    if held:
        hint = (f"it holds a partial prepare that was cut off; remove it (rm -r {out}) and run again"
                if any(name.endswith(".bin") for name in held) else "choose a new directory")
        raise DataError(f"--out {out} exists and is not an empty directory; {hint}")


class Interrupted(DataError):
    """SIGTERM or SIGINT reached ``prepare``: its workers are ended and its output removed on the way out."""


@contextlib.contextmanager
def _signals_interrupt(out: Path) -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Interrupted` while ``prepare`` writes, so the workers and partial
    shards go with it (by default SIGTERM ends the parent at once and leaves both behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(f"prepare interrupted by {signal.Signals(signum).name}; nothing was kept in {out}")

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _results(workers: Workers, files: list[Path]) -> Iterator[tuple[list[np.ndarray], list[bool], int]]:
    """Tokenized batches in input order, with their document ends and input bytes."""
    meta: dict[int, tuple[list[bool], int]] = {}

    def jobs() -> Iterator[tuple[list[tuple[str, bool]], str]]:
        for k, (batch, consumed, label) in enumerate(_batches(files)):
            meta[k] = ([ends for _, ends in batch], consumed)
            yield batch, label

    for k, arrays in enumerate(workers.ordered(jobs())):
        ends, consumed = meta.pop(k)
        yield arrays, ends, consumed


def prepare(opts: PrepareOptions, stream: TextIO | None = None) -> Index:
    """Tokenize ``opts.inputs`` into shards and an index under ``opts.out`` (progress on ``stream``, default
    stderr); returns the index. On any failure what was written is removed (see the module docstring)."""
    from trainmesh.data.tokenizer import TokenizerFile, load_tokenizer

    stream = stream or sys.stderr
    source = chat.tokenizer_json(opts.tokenizer) if opts.chat else opts.tokenizer
    pinned = TokenizerFile.read(source) if source else None
    tok = pinned.load() if pinned else load_tokenizer("")
    if pinned is None or tok.eos_id is None:
        raise DataError(f"tokenizer {opts.tokenizer or '(bytes)'} has no end-of-document token to put between "
                        f"documents; train one with: trainmesh tokenizer train --out tok.json")
    files = input_files(list(opts.inputs))
    out = Path(opts.out)
    created = _make_out_dir(out)
    try:
        with runlock.hold(out, "--out"), _signals_interrupt(out):
            _check_empty(out)
            write = _write_chat_shards if opts.chat else _write_shards
            return write(opts, out, files, pinned, tok, stream)
    except runlock.DirectoryInUse:
        raise
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # empty again: the failed run removed its files, the lock its file
        raise


def _write_shards(opts: PrepareOptions, out: Path, files: list[Path], pinned: TokenizerFile, tok: Tokenizer,
                  stream: TextIO) -> Index:
    """Tokenize ``files`` into ``out`` (locked and empty); on any failure remove what was written."""
    dtype = token_dtype(tok.vocab_size)
    writers = {s: SplitWriter(out, s, dtype, opts.shard_tokens) for s in ("train", "val")}
    meter = ProgressMeter(sum(input_size(f) for f in files), stream)
    doc, t0 = 0, time.perf_counter()
    try:
        with Workers(opts.workers, pinned, dtype) as workers:
            for arrays, ends, consumed in _results(workers, files):
                for ids, end in zip(arrays, ends):
                    writers["val" if _held_out(doc, opts.val_fraction) else "train"].write(ids, end)
                    doc += end
                meter.add(consumed)
        meter.close()
        index = _publish(out, list(writers.values()), pinned, tok, dtype)
    except BaseException as e:
        meter.close()
        _discard(out, writers.values())
        if isinstance(e, WorkerDied):
            raise WorkerDied(f"{e}; nothing was kept in {out}") from None
        raise
    summary = index.to_json()
    seconds = time.perf_counter() - t0
    tokens = sum(summary["tokens"].values())
    stream.write(f"prepared {doc:,} documents, {tokens:,} tokens ({summary['tokens']['val']:,} held out) into "
                 f"{len(index.shards)} shard(s) in {out} in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s, "
                 f"{meter.done / seconds / 1e6:.2f} MB/s)\n")
    return index


def _write_chat_shards(opts: PrepareOptions, out: Path, files: list[Path], pinned: TokenizerFile, tok: Tokenizer,
                       stream: TextIO) -> Index:
    """Render and tokenize ``files``' conversations (in this process) into token shards and label shards cut at
    the same conversation ends; on any failure remove what was written."""
    renderer = chat.ChatRenderer(opts.tokenizer, tok, opts.train_on)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: (SplitWriter(out, s, dtype, opts.shard_tokens),
                   SplitWriter(out, s, LABEL_DTYPE, opts.shard_tokens, LABELS_SUFFIX)) for s in ("train", "val")}
    meter = ProgressMeter(sum(input_size(f) for f in files), stream)
    doc, trained, t0 = 0, 0, time.perf_counter()
    try:
        chat.keep_template(opts.tokenizer, pinned.data, out)
        for f in files:
            for where, messages, size in chat.conversations(f):
                ids, labels = renderer.encode(messages, where)
                for writer, data in zip(writers["val" if _held_out(doc, opts.val_fraction) else "train"], (ids, labels)):
                    writer.write(data, True)
                doc, trained = doc + 1, trained + int(np.count_nonzero(labels & chat.TRAINED))
                meter.add(size)
        meter.close()
        index = _publish(out, [w for pair in writers.values() for w in pair], pinned, tok, dtype, opts.train_on)
    except BaseException:
        meter.close()
        _discard(out, [w for pair in writers.values() for w in pair])
        shutil.rmtree(out / chat.TEMPLATE_DIR, ignore_errors=True)
        raise
    tokens = sum(s.tokens for s in index.shards)
    stream.write(f"prepared {doc:,} conversations, {tokens:,} tokens ({trained:,} trained: {opts.train_on}) into "
                 f"{len(index.shards)} shard(s) in {out} in {time.perf_counter() - t0:.1f} s\n")
    return index


def _publish(out: Path, writers: list[SplitWriter], pinned: TokenizerFile, tok: Tokenizer, dtype: np.dtype,
             train_on: str = "") -> Index:
    """Close ``writers`` (tokens, and labels beside them for chat data), keep the tokenizer beside the data and
    write the index last."""
    from trainmesh.data.tokenizer import TOKENIZER_FILE

    for w in writers:
        w.close()
    replace_durably(out / TOKENIZER_FILE, pinned.data)  # the data keeps its tokenizer; the index names only this copy
    shards = [s for w in writers if w.suffix == ".bin" for s in w.shards]
    labels = {s.file.removesuffix(LABELS_SUFFIX): s.sha256 for w in writers if w.suffix == LABELS_SUFFIX
              for s in w.shards}
    shards = [dataclasses.replace(s, labels_sha256=labels.get(s.file.removesuffix(".bin"), "")) for s in shards]
    index = Index(out, dtype, tok.vocab_size, tok.eos_id, pinned.sha256, TOKENIZER_FILE,
                  tuple(shards), train_on)
    _write_index(index)
    return index


def _discard(out: Path, writers: Iterable[SplitWriter]) -> None:
    """Remove what a failed run wrote: its shards and a half-written index (``out`` itself, if the run made
    it, goes once the lock is released)."""
    for w in writers:
        w.discard()
    (out / (INDEX_FILE + ".tmp")).unlink(missing_ok=True)


def _write_index(index: Index) -> None:
    tmp = index.root / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index.to_json(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, index.root / INDEX_FILE)

